"""`meshd model create-tiny DIR [--arch ARCH] [--seed S]`: write the synthetic tiny MoE."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshd.errors import RuntimeFailure, UsageError


def run(args: argparse.Namespace) -> int:
    if args.model_command != "create-tiny":
        raise UsageError(f"unknown model command {args.model_command!r}")
    from engine.tiny import create_tiny

    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    target = Path(args.dir).expanduser()
    if target.exists() and not target.is_dir():
        raise UsageError(f"{target} exists and is not a directory")
    try:
        out = create_tiny(target, arch=args.arch, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise RuntimeFailure(f"cannot write {target}: {e.strerror or e}") from None
    sys.stdout.write(f"{out}\n")
    return 0
