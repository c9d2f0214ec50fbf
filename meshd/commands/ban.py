"""`meshd ban NODE_ID`: revoke a member mesh-wide (the daemon must hold the mesh admin key)."""

from __future__ import annotations

import argparse
import os
import sys

from meshd.control import call
from meshd.errors import UsageError
from meshd.state import CONTROL_SOCKET, resolve_state_dir
from transport.identity import is_node_id


def run(args: argparse.Namespace) -> int:
    if not is_node_id(args.node_id):
        raise UsageError("NODE_ID must be 32 lowercase hex characters (see `meshd status`)")
    state_dir = resolve_state_dir(args.state_dir, os.environ)
    reply = call(state_dir / CONTROL_SOCKET, "ban", node_id=args.node_id)
    note = " (already banned)" if reply.get("already") else ""
    sys.stdout.write(f"banned {reply['banned']}{note} (ban list version {reply['version']})\n")
    return 0
