"""The pipeline part of `meshd status` (text): each served model's plan with per-stage timings, and the
ranges this node holds as a stage. Reads ``services.pipeline.pipeline`` of the status object (the same
fields ``--json`` prints)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Table = Callable[..., str]


def num(value: Any, fmt: str = "{:.2f}") -> str:
    """A number for a status cell ("-" when it is missing or not a number; a bool is not one)."""
    return "-" if not isinstance(value, int | float) or isinstance(value, bool) else fmt.format(value)


def _layers(value: Any) -> str:
    if not isinstance(value, list) or len(value) != 2:
        return "-"
    return f"{value[0]}-{value[1]}"


def _model(name: str, m: dict[str, Any], node_id: str, table: Table) -> str:
    head = f"  model {name}: mode {m.get('mode')}, fingerprint {m.get('fingerprint')}"
    run_id = m.get("run")
    runs = m.get("runs") or {}
    run = runs.get(run_id) if isinstance(runs, dict) else None
    if run_id:
        head += f", run {run_id}"
    if isinstance(run, dict):
        head += f", live sequences {run.get('live_sequences', 0)}"
    text = head + "\n"
    if m.get("unavailable"):
        text += f"    unavailable: {m['unavailable']}\n"
    if m.get("local_fallback"):
        text += f"    running alone: {m['local_fallback']}\n"
    plan = m.get("plan")
    if plan:
        stats = {s.get("node_id"): s for s in (run or {}).get("stages") or [] if isinstance(s, dict)}
        rows = [["NODE", "LAYERS", "PATH", "RTT_MS", "CALLS", "DIRECT_CALLS", "LAT_MS", "COMPUTE_MS", "HOP_MS", "MAX_MS"]]
        for i, stage in enumerate(plan):
            nid = str(stage.get("node_id") or "-")
            layers = _layers(stage.get("layers"))
            if i == len(plan) - 1 and layers != "-":
                layers += "+head"
            s = stats.get(nid, {}) if i else {}
            rows.append(
                [
                    (nid + " (this node)") if i == 0 or nid == node_id else nid,
                    layers,
                    str(s.get("path") or "-") + ("+direct" if s.get("direct") else ""),  # a direct channel is up
                    num(s.get("path_rtt_ms_avg") if s.get("path_rtt_ms_avg") is not None else s.get("rtt_ms")),
                    num(s.get("calls"), "{}"),
                    num(s.get("direct_calls"), "{}"),
                    num(s.get("latency_ms_avg")),
                    num(s.get("compute_ms_avg")),
                    num(s.get("hop_overhead_ms_avg")),
                    num(s.get("latency_ms_max")),
                ]
            )
        text += table(rows, "    ")
    elif not m.get("unavailable"):
        text += "    no plan yet\n"
    for r in m.get("refused") or []:
        text += f"    refused {r.get('node_id')}: {r.get('reason')}\n"
    for n in m.get("loading") or []:
        text += f"    loading {n}: its --stage weights are not loaded yet (not planned on)\n"
    if m.get("recoveries"):
        text += f"    recoveries {m['recoveries']} (last {num(m.get('last_recovery_ms'), '{:.0f}')} ms)\n"
    return text


def format_pipeline(st: dict[str, Any], table: Table) -> str:
    """The pipeline section, or "" when this node neither serves a pipelined model nor holds a stage."""
    pipe = ((st.get("services") or {}).get("pipeline") or {}).get("pipeline") or {}
    models = pipe.get("models") or {}
    stages = pipe.get("stages") or []
    if not models and not stages and not pipe.get("loading"):
        return ""
    text = f"pipeline  {pipe.get('pipeline', 'off')}\n"
    if pipe.get("loading"):
        text += f"  loading {pipe['loading']}\n"  # this node's --stage checkpoints: not offered yet
    if pipe.get("numerics"):
        text += f"  numerics {pipe['numerics']}\n"  # this node's tag (engine/numerics.py): stages must match it
    for name, m in sorted(models.items()):
        text += _model(name, m, str(st.get("node_id") or ""), table)
    if stages:
        rows = [["STAGE", "FINGERPRINT", "PIN", "LOADED", "LIVE_SEQS", "STEPS", "COMPUTE_MS"]]
        for s in stages:
            rows.append(
                [
                    str(s.get("path")),
                    str(s.get("fingerprint")),
                    _layers(s.get("pin")),
                    ",".join(_layers(r) for r in s.get("loaded") or []) or "-",
                    num(s.get("live_sequences"), "{}"),
                    num(s.get("steps"), "{}"),
                    num(s.get("compute_ms_avg")),
                ]
            )
        text += table(rows)
    return text
