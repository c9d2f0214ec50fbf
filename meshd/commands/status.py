"""`meshd status [--json]`: ask the running daemon (control socket) for its status and print it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from meshd.commands.status_experts import format_experts
from meshd.commands.status_pipeline import format_pipeline
from meshd.control import call
from meshd.state import CONTROL_SOCKET, resolve_state_dir


def run(args: argparse.Namespace) -> int:
    state_dir = resolve_state_dir(args.state_dir, os.environ)
    status = call(state_dir / CONTROL_SOCKET, "status")
    if args.json:
        sys.stdout.write(json.dumps(status) + "\n")
    else:
        sys.stdout.write(format_status(status))
    return 0


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(_cell(v) if not isinstance(v, dict) else str(v.get("name", v)) for v in value) or "-"
    return str(value)


def _table(rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in rows)


def _numerics_labels(mine: Any, theirs: list[Any]) -> dict[Any, str]:
    """A short label per numerics tag (engine/numerics.py) in the peers table: ``=`` for this node's, ``N1``,
    ``N2``... for the others in order of appearance (the legend below the table spells them out). A peer
    that gossips none (no engine model, or an older meshd) gets no label."""
    labels: dict[Any, str] = {mine: "="} if isinstance(mine, str) and mine else {}
    for tag in theirs:
        if isinstance(tag, str) and tag and tag not in labels:
            labels[tag] = f"N{sum(1 for v in labels.values() if v != '=') + 1}"
    return labels


def _numerics_legend(mine: Any, labels: dict[Any, str]) -> str:
    """Which numerics each label stands for, and what differs from this node's: output is byte-identical
    across nodes only with equal tags (docs/pipeline.md, "Same numerics on every stage")."""
    from engine.numerics import difference

    if not labels:
        return ""
    text = f"numerics  = {mine} (this node)\n" if isinstance(mine, str) and mine in labels else ""
    for tag, label in labels.items():
        if label == "=":
            continue
        text += f"  {label} {tag}\n"
        if isinstance(mine, str) and mine:
            text += f"     differs: {difference(mine, tag, 'here', 'there')}\n"
    if text and not text.startswith("numerics"):
        text = "numerics  (this node computes no model: no tag)\n" + text
    return text


def format_status(st: dict[str, Any]) -> str:
    """The human-readable form of a status object."""
    mesh = "-" if not st.get("mesh_id") else f"{st.get('mesh_name')} ({st.get('mesh_id')})"
    if st.get("admin"):
        mesh += " [admin key held]"
    out = [
        f"node      {st.get('node_id')}  ({st.get('role', '?')}, {st.get('state')})",
        f"mesh      {mesh}",
        f"quic      {_cell(st.get('quic'))}",
        f"api       {_cell(st.get('api'))}",
        f"version   {st.get('version')} (protocol {st.get('protocol')})",
    ]
    text = "\n".join(out) + "\n"
    models = st.get("models") or []
    text += f"models    {len(models)}\n"
    if models:
        rows = [["NAME", "KIND", "FINGERPRINT"]]
        rows += [[_cell(m.get("name")), _cell(m.get("kind")), _cell(m.get("fingerprint"))] for m in models]
        text += _table(rows)
    peers = st.get("peers") or []
    text += f"peers     {len(peers)}\n"
    mine = ((st.get("services") or {}).get("membership") or {}).get("numerics")
    labels = _numerics_labels(mine, [p.get("numerics") for p in peers])
    if peers:
        rows = [["NODE", "ROLE", "STATE", "RTT_MS", "LAST_SEEN_S", "ADDRS", "MODELS", "VERSION", "NUMERICS"]]
        for p in peers:
            rtt = p.get("rtt_ms")
            live = p.get("state") in ("alive", "suspect", None)
            rows.append(
                [
                    _cell(p.get("node_id")),
                    _cell(p.get("role")),
                    _cell(p.get("state")),
                    "-" if rtt is None else f"{rtt:.1f}" if isinstance(rtt, (int, float)) else str(rtt),
                    _cell(p.get("last_seen_s")),
                    _cell(p.get("addrs")),
                    _cell(p.get("models")) if live else "-",  # a dead node serves nothing
                    _cell(p.get("version")),
                    labels.get(p.get("numerics"), "-"),
                ]
            )
        text += _table(rows)
    text += _numerics_legend(mine, labels)
    text += format_pipeline(st, _table)
    text += format_experts(st, _table)
    banned = (st.get("services") or {}).get("membership", {}).get("banned") or []
    text += f"banned    {len(banned)}\n"
    text += "".join(f"  {b}\n" for b in banned)
    return text
