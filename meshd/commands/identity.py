"""`meshd identity`: print this node's id, creating its key if there is none yet."""

from __future__ import annotations

import argparse
import os
import sys

from meshd.state import StateDir, resolve_state_dir


def run(args: argparse.Namespace) -> int:
    state = StateDir(resolve_state_dir(args.state_dir, os.environ))
    identity, _created = state.load_or_create_identity()
    sys.stdout.write(identity.node_id + "\n")
    return 0
