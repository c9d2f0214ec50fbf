"""`meshd invite [--ttl DURATION] [--uses N]`: ask the running daemon for an invite token (stdout)."""

from __future__ import annotations

import argparse
import os
import sys

from meshd.control import call
from meshd.errors import UsageError
from meshd.membership.service import parse_duration
from meshd.state import CONTROL_SOCKET, resolve_state_dir


def run(args: argparse.Namespace) -> int:
    ttl = parse_duration(args.ttl)
    if args.uses < 1:
        raise UsageError("--uses must be at least 1")
    state_dir = resolve_state_dir(args.state_dir, os.environ)
    reply = call(state_dir / CONTROL_SOCKET, "invite", ttl_s=ttl, uses=args.uses)
    sys.stdout.write(reply["token"] + "\n")
    return 0
