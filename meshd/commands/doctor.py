"""`meshd doctor [--json]`: check what usually breaks a mesh and say how to fix it (meshd.mesh.doctor)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from meshd.control import NoDaemon, call
from meshd.errors import RuntimeFailure
from meshd.mesh.doctor import Check, run_checks
from meshd.state import CONTROL_SOCKET, resolve_state_dir

MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def run(args: argparse.Namespace) -> int:
    state_dir = resolve_state_dir(args.state_dir, os.environ)
    status, error = None, None
    try:
        status = call(state_dir / CONTROL_SOCKET, "status")
    except NoDaemon as e:
        error = e.reason  # the check says "no running daemon" itself
    except (RuntimeFailure, OSError) as e:
        error = str(e)
    proto = None
    try:
        from transport.credentials import Genesis

        g = Genesis.decode((state_dir / "genesis.json").read_bytes())
        proto = (g.proto_min, g.proto_max)
    except Exception:  # noqa: BLE001 - no mesh yet, or unreadable: the other checks say why
        proto = None
    checks = run_checks(state_dir, status, error, proto)
    if args.json:
        sys.stdout.write(json.dumps([asdict(c) for c in checks]) + "\n")
    else:
        sys.stdout.write(format_checks(checks))
    return 1 if any(c.level == "fail" for c in checks) else 0


def format_checks(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    out = []
    for c in checks:
        out.append(f"{MARK[c.level]}  {c.name.ljust(width)}  {c.detail}")
        if c.fix and c.level != "ok":
            out.append(f"      {' ' * width}  fix: {c.fix}")
    return "\n".join(out) + "\n"
