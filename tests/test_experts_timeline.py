"""bench/experts_timeline.py's trace points and timeline, on a real worker process over the data lane and
over QUIC on loopback."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import experts_trace
import numpy as np
import pytest
from experts_mesh import Coordinator, MeshFixture, spawn_worker

from engine.model import Model
from engine.tiny import create_tiny

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import experts_timeline as timeline  # noqa: E402

PROMPT = [5, 17, 3, 42, 9, 28, 61, 11]
STEPS = 4
ECHOES = 10
WITHIN = 0.5  # s a point may come after the one before: on a loaded 2-core machine a process waits ~10 ms


@pytest.mark.parametrize("path", ["lane", "quic"])
def test_the_timeline_follows_each_delegated_layer_and_echo_through_both_processes(tmp_path: Path,
                                                                                  path: str) -> None:
    from aioquic.quic.connection import QuicConnection

    from transport.lane_conn import LaneConnection

    original = QuicConnection.receive_datagram
    original_lane = LaneConnection.data_received
    ckpt = create_tiny(tmp_path / "tiny", arch="qwen3_moe", seed=1)
    model = Model.load(ckpt)
    mesh = MeshFixture()
    rec = experts_trace.Recorder()
    rec.on = False
    experts_trace.install(rec)
    trace_file = tmp_path / "worker-trace.json"
    try:
        worker = spawn_worker(mesh, tmp_path, [str(ckpt)], trace=str(trace_file), lane=path == "lane")
        try:
            from engine.experts.coordinator import CoordinatorConfig

            coord = Coordinator(mesh, CoordinatorConfig(direct=False), lane=path == "lane")  # the stream path
            try:
                coord.connect([worker])
                ex = coord.executor(ckpt, "on")
                coord.wait_paths([worker], path)
                cache = model.new_cache()
                out = model.forward(PROMPT, cache, executor=ex)[-1]
                rec.on, t0 = True, time.perf_counter()
                for _ in range(STEPS):
                    out = model.forward([int(np.argmax(out))], cache, executor=ex)[-1]
                t1 = time.perf_counter()
                for _ in range(ECHOES):
                    ex.echo_rtt(next(iter(ex.links)), os.urandom(4096), polled=True)
                t2, rec.on = time.perf_counter(), False
            finally:
                coord.close()
        finally:
            worker.stop()
    finally:
        experts_trace.uninstall()
    assert QuicConnection.receive_datagram is original  # the originals are back
    assert LaneConnection.data_received is original_lane

    s = timeline.Streams(list(rec.events), [tuple(e) for e in json.loads(trace_file.read_text())])
    starts = s.starts("dispatch", [(t0, t1)])
    assert len(starts) == STEPS * len(model.sparse_layers)  # one dispatch per delegated layer
    layers = [timeline.chain(s, t, True, WITHIN) for t in starts]
    names = {name for name, *_ in timeline.LAYER}
    tails = 0
    for start, segs in zip(starts, layers):
        assert segs is not None and names <= set(segs)
        assert all(v >= 0 for v in segs.values())  # one clock for both processes: causality holds
        # the segments are contiguous: together they are the dispatch-to-reply time
        reply = s.next("C", start, "reply", within=WITHIN)
        assert reply is not None and abs(sum(segs[n] for n in names) - (reply[0] - start)) < 1e-9
        assert segs["expert compute"] > 0
        tails += timeline.TAIL[1][0] in segs  # the pass's compute up to the same token's next layer
    assert tails == STEPS * (len(model.sparse_layers) - 1)  # every layer but each token's last
    echoes = [timeline.chain(s, t, False, WITHIN) for t in s.starts("out1", [(t1, t2)], min_size=4096)]
    assert len(echoes) == ECHOES and all(e is not None and "expert compute" not in e for e in echoes)
