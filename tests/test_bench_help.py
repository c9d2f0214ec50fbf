"""Every benchmark's options and positionals have a help line that states its default (as the CLI's do)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT

# Run in one child: each bench script runs as __main__ until it parses its arguments; the parser is then
# read (tests/help_check.py, the CLI's rule) and the script stopped (nothing is benchmarked). Only scripts that build a parser are run (the others
# are children of a bench, started with their work on the command line).
_DRIVER = r"""
import argparse, json, runpy, sys
sys.path.insert(0, "tests")
from help_check import undocumented

class Parsed(Exception):
    pass

found = {}
def _capture(self, args=None, namespace=None):
    found["parser"] = self
    raise Parsed

argparse.ArgumentParser.parse_known_args = _capture
out = {}
for path in sys.argv[1:]:
    found.clear()
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except Parsed:
        pass
    except SystemExit:
        pass
    p = found.get("parser")
    missing = undocumented(p) if p is not None else []
    out[path] = {"parser": p is not None, "missing": missing}
print(json.dumps(out))
"""


def _check(paths: list[Path]) -> dict:
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *map(str, paths)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_bench_option_says_its_default() -> None:
    benches = sorted(p for p in (REPO_ROOT / "bench").glob("*.py") if "ArgumentParser(" in p.read_text())
    res = _check(benches)
    assert all(r["parser"] for r in res.values()), res  # the driver really reached every parser
    assert {p: r["missing"] for p, r in res.items() if r["missing"]} == {}


def test_the_bench_check_can_fail(tmp_path: Path) -> None:
    script = tmp_path / "b.py"
    script.write_text("import argparse\nap = argparse.ArgumentParser()\nap.add_argument('--n', default=3)\n"
                      "ap.add_argument('--m', default=1, help='m things')\nap.parse_args()\n")
    res = _check([script])
    assert res[str(script)] == {"parser": True, "missing": ["--n: no help", "--m: help does not say its default"]}


def test_bench_children_without_a_parser_answer_help_without_a_traceback() -> None:
    # hostile_probe.py read '--help' as its CONFIG file and pipeline_imports.py imported a module '--help':
    # both printed a traceback to a user trying `python bench/X.py --help`
    kids = sorted(p for p in (REPO_ROOT / "bench").glob("*.py")
                  if "ArgumentParser(" not in p.read_text() and "__main__" in p.read_text())
    assert {p.name for p in kids} >= {"hostile_probe.py", "pipeline_imports.py"}
    for p in kids:
        out = subprocess.run([sys.executable, str(p), "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 0 and "Traceback" not in out.stderr and out.stdout.strip(), (p.name, out.stderr[-500:])
