"""`meshd join TOKEN` (or `meshd join -`, the token on standard input): make the running daemon join the token's mesh without restarting."""

from __future__ import annotations

import argparse
import os
import sys

from discovery.invite import InviteError, InviteToken
from meshd.config import read_token_stdin
from meshd.control import call
from meshd.errors import UsageError
from meshd.state import CONTROL_SOCKET, resolve_state_dir

JOIN_TIMEOUT_S = 40.0  # the daemon retries an unreachable issuer for up to 20 s


def run(args: argparse.Namespace) -> int:
    on_argv = args.token != "-"
    if not on_argv:
        args.token = read_token_stdin("meshd join -")
    try:  # a malformed or tampered token is a usage error (exit 2), as for `serve --join`
        InviteToken.decode(args.token)
    except InviteError as e:
        raise UsageError(str(e)) from None
    if on_argv:
        sys.stderr.write("meshd: warning: a token on the command line is visible to every local user in ps; "
                         "use 'meshd join -' and paste it, or pipe it in\n")
    state_dir = resolve_state_dir(args.state_dir, os.environ)
    reply = call(state_dir / CONTROL_SOCKET, "join", timeout_s=JOIN_TIMEOUT_S, token=args.token)
    sys.stdout.write(f"joined mesh {reply['mesh_name']} ({reply['mesh_id']})\n")
    return 0
