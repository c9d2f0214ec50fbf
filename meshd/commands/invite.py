"""`meshd invite` (the membership issue implements it)."""

from __future__ import annotations

import argparse

from meshd.errors import UsageError


def run(args: argparse.Namespace) -> int:
    raise UsageError("'invite' is not yet available in this build")
