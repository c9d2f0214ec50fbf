"""The help-line rule for the CLI and the benchmarks: every option and positional has a help line that states
its default (or that it is required). Hidden options (``argparse.SUPPRESS``) are not shown, so not checked."""

from __future__ import annotations

import argparse

_SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def undocumented(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    """``prefix + "NAME: why"`` for each of ``parser``'s own arguments that breaks the rule."""
    missing = []
    for a in parser._actions:
        if isinstance(a, _SKIP) or a.help == argparse.SUPPRESS:
            continue
        name = "/".join(a.option_strings) or a.dest
        text = a.help or ""
        if not text.strip():
            missing.append(f"{prefix}{name}: no help")
        elif "default" not in text and "required" not in text:
            missing.append(f"{prefix}{name}: help does not say its default")
    return missing
