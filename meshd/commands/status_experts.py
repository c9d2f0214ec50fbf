"""The expert part of `meshd status` (text): per coordinated checkpoint its workers (connected, direct
channel, calls and timings) and the workers it refused, with the reason (another checkpoint, other numerics);
on a worker the shards it holds. Reads ``services.experts`` of the status object (the fields ``--json``
prints)."""

from __future__ import annotations

from typing import Any

from meshd.commands.status_pipeline import Table, num


def _yes(value: Any) -> str:
    return "-" if value is None else "yes" if value else "no"


def _ranges(values: Any) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
        return "-"
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = out[-1].split("-")[0] + f"-{v}"
        else:
            out.append(str(v))
    return ",".join(out) or "-"


def format_experts(st: dict[str, Any], table: Table) -> str:
    """The experts section, or "" when this node neither hands experts to workers nor is a worker."""
    ex = (st.get("services") or {}).get("experts") or {}
    coordinators = ex.get("coordinators") or []
    worker = ex.get("worker")
    if not coordinators and not isinstance(worker, dict):
        return ""
    text = f"experts   remote {ex.get('remote_experts', 'off')}\n"
    if ex.get("numerics"):
        text += (
            f"  numerics {ex['numerics']}\n"  # this node's tag (engine/numerics.py): workers must match it
        )
    for c in coordinators:
        covered = (
            "every expert has a live worker" if c.get("covered") else "not every expert has a live worker"
        )
        text += f"  model {c.get('path')}: mode {c.get('mode')}, {covered}\n"
        workers = c.get("workers") or {}
        if workers:
            rows = [
                [
                    "WORKER",
                    "CONNECTED",
                    "DIRECT",
                    "CALLS",
                    "DIRECT_CALLS",
                    "LAT_MS",
                    "COMPUTE_MS",
                    "MAX_MS",
                    "ERRORS",
                ]
            ]
            for nid, w in sorted(workers.items()):
                rows.append(
                    [
                        str(nid),
                        _yes(w.get("connected")),
                        _yes(w.get("direct")),
                        num(w.get("calls"), "{}"),
                        num(w.get("direct_calls"), "{}"),
                        num(w.get("latency_ms_avg")),
                        num(w.get("compute_ms_avg")),
                        num(w.get("latency_ms_max")),
                        num(w.get("errors"), "{}"),
                    ]
                )
            text += table(rows, "    ")
        elif not c.get("loading"):
            text += "    no workers yet\n"
        for nid in sorted(c.get("loading") or {}):  # up, experts not loaded yet: not an error
            text += f"    loading {nid}: its experts are not loaded yet\n"
        for nid, reason in sorted((c.get("refused") or {}).items()):
            text += f"    refused {nid}: {reason}\n"
    if isinstance(worker, dict):
        text += f"  worker: requests {num(worker.get('requests'), '{}')}, errors {num(worker.get('errors'), '{}')}\n"
        shards = worker.get("shards") or []
        if shards:
            rows = [["SHARD", "FINGERPRINT", "LAYERS", "EXPERTS"]]
            rows += [
                [
                    str(s.get("path")),
                    str(s.get("fingerprint"))[:16],
                    _ranges(s.get("layers")),
                    _ranges(s.get("experts")),
                ]
                for s in shards
            ]
            text += table(rows, "    ")
    return text
