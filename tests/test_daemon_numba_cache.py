"""The daemon's numba cache directory (meshd/numba_cache.py): numba's own locations when one is writable,
the state directory's ``numba-cache`` when none is (a read-only install without a home, as under the shipped
systemd unit, where numba otherwise refuses to define the engine's cached kernels), a ``NUMBA_CACHE_DIR``
already set wins. Unwritable locations are paths under a regular file (mkdir fails even for root)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from meshd import numba_cache


def test_state_dir_only_when_no_numba_location_is_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    dead = [blocker / "engine" / "__pycache__", blocker / "home" / ".cache" / "numba"]
    state = tmp_path / "state"
    assert numba_cache.choose(state, dead) == state / numba_cache.SUBDIR
    assert numba_cache.choose(state, [dead[0], tmp_path / "cache" / "numba"]) is None  # the user-wide one
    assert numba_cache.choose(state, [tmp_path / "tree" / "__pycache__", dead[1]]) is None  # beside the sources
    assert numba_cache.writable(tmp_path / "cache" / "numba") and not numba_cache.writable(dead[0])


def test_numba_locations_follow_xdg_and_home(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path / "h"), "XDG_CACHE_HOME": str(tmp_path / "x")}
    locs = numba_cache.numba_locations(env)
    assert locs[0] == Path(importlib.util.find_spec("engine").origin).parent / "__pycache__"  # type: ignore[union-attr,arg-type]
    assert locs[1] == tmp_path / "x" / "numba"
    assert numba_cache.numba_locations({"HOME": str(tmp_path / "h")})[1] == tmp_path / "h" / ".cache" / "numba"


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed (the [fast] extra)")
def test_apply_sets_the_variable_only_when_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    state = tmp_path / "state"
    env = {"NUMBA_CACHE_DIR": "/somewhere"}
    assert numba_cache.apply(state, env) is None and env == {"NUMBA_CACHE_DIR": "/somewhere"}
    monkeypatch.setattr(numba_cache, "numba_locations", lambda env: [blocker / "a", blocker / "b"])
    env = {}
    assert numba_cache.apply(state, env) == state / numba_cache.SUBDIR
    assert env == {"NUMBA_CACHE_DIR": str(state / numba_cache.SUBDIR)} and (state / numba_cache.SUBDIR).is_dir()
    monkeypatch.setattr(numba_cache, "numba_locations", lambda env: [tmp_path / "ok"])
    env = {}
    assert numba_cache.apply(state, env) is None and env == {}
