"""Memory: two workers each holding half of the experts have about half the resident expert bytes.

Resident bytes are read from ``/proc/PID/smaps``: the ``Rss`` of the worker's mappings of the checkpoint
file (its shard maps only held tensors, so this is the expert bytes it touched), reported against the
shard's expert byte count and the process RSS. The coordinator's own model mapping stays at about the
non-expert bytes after remote forwards: it touched no routed-expert pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import structlog
from experts_mesh import Coordinator, MeshFixture, spawn_worker
from experts_util import make_moe_checkpoint

from engine.experts.shard import load_shard
from engine.model import Model

log = structlog.get_logger(__name__)


def file_rss(pid: int | str, path: Path) -> int:
    """Resident bytes of every mapping of ``path`` in process ``pid``."""
    total, current = 0, False
    target = str(path.resolve())
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            current = len(parts) >= 6 and parts[5] == target
        elif current and parts and parts[0] == "Rss:":
            total += int(parts[1]) * 1024
    return total


def process_rss(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_two_half_workers_each_hold_about_half(tmp_path: Path) -> None:
    ck = make_moe_checkpoint(tmp_path / "big", layers=4, experts=8, top_k=2, hidden=256, inter=512, seed=6)
    file = ck / "model.safetensors"
    full = load_shard(str(ck))
    total_expert = full.expert_bytes  # 4 layers x 8 experts x 3 x 256 x 512 x 4 B = 48 MiB
    full.close()
    mesh = MeshFixture()
    lo = spawn_worker(mesh, tmp_path, [f"{ck}@0-3/0-3"])
    hi = spawn_worker(mesh, tmp_path, [f"{ck}@0-3/4-7"])
    coord = Coordinator(mesh)
    try:
        coord.connect([lo, hi])
        ex = coord.executor(ck, "on")
        model = Model.load(ck)  # the coordinator's own mapping, used only with the remote executor
        rng = np.random.default_rng(0)
        for _ in range(4):  # enough tokens that every expert is routed to
            model.forward(rng.integers(0, 64, 48).tolist(), model.new_cache(), executor=ex)
        hits = ex.stats.expert_rows
        assert len(hits) == 32, "every expert should have been used"
        report = {}
        for name, w in (("lo", lo), ("hi", hi)):
            resident = file_rss(w.proc.pid, file)
            report[name] = {"expert_bytes_resident": resident, "process_rss": process_rss(w.proc.pid),
                            "total_expert_bytes": total_expert}
            assert 0.45 * total_expert <= resident <= 0.56 * total_expert, report
        coord_resident = file_rss("self", file)
        non_expert = file.stat().st_size - total_expert
        report["coordinator"] = {"file_resident": coord_resident, "non_expert_bytes": non_expert}
        # The pytest process also maps the file for load_shard (closed) and the model; the model's mapping
        # holds only what the non-expert layers touched.
        assert coord_resident <= non_expert + 0.05 * total_expert, report
        log.info("experts_memory_report", report=json.dumps(report))
        print(json.dumps(report))
    finally:
        coord.close()
        lo.stop()
        hi.stop()
