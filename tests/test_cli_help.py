"""Every CLI option and positional has a help line that states its default (or that it is required)."""

from __future__ import annotations

import argparse
import subprocess

import pytest
from conftest import meshd_cmd, meshd_env
from help_check import undocumented

from meshd.cli import build_parser


def _parsers(p: argparse.ArgumentParser, path: str = "meshd") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, p)]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                out += _parsers(sp, f"{path} {name}")
    return out


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [m for path, p in _parsers(parser) for m in undocumented(p, f"{path} ")]


def test_every_option_and_positional_says_its_default() -> None:
    assert _undocumented(build_parser()) == []


def test_the_check_can_fail() -> None:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["status"].add_argument("--undocumented")
    sub.choices["status"].add_argument("--vague", help="something")
    assert _undocumented(p) == ["meshd status --undocumented: no help",
                                "meshd status --vague: help does not say its default"]


@pytest.mark.parametrize("cmd", ["serve", "client", "generate", "join", "ban", "status", "invite"])
def test_help_runs_and_shows_defaults(cmd: str) -> None:
    out = subprocess.run(meshd_cmd(cmd, "--help"), env=meshd_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "default" in out.stdout, out.stderr
