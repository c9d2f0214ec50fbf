"""`meshd serve --join TOKEN` on a node that already founded a mesh of its own (the README's path when a
machine ran `meshd serve` once before being invited): it moves to the token's mesh; a refused token stops
it with the reason and leaves its own mesh untouched."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from conftest import meshd_cmd, meshd_env
from daemon_testlib import start_node


def _invite(state: Path) -> str:
    return subprocess.run(meshd_cmd("invite", "--state-dir", str(state)), env=meshd_env(), capture_output=True,
                          text=True, timeout=20, check=True).stdout.strip()


def test_solo_node_started_with_join_moves_to_the_tokens_mesh(tmp_path: Path) -> None:
    a = start_node(tmp_path / "a")
    nodes = [a]
    try:
        b = start_node(tmp_path / "b")  # founds a mesh of its own
        solo_mesh = b.run["mesh_id"]
        assert solo_mesh != a.run["mesh_id"]
        b.stop()
        token = _invite(tmp_path / "a")
        b = start_node(tmp_path / "b", "--join", token)
        nodes.append(b)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and b.status()["mesh_id"] != a.run["mesh_id"]:
            time.sleep(0.2)
        st = b.status()
        assert st["mesh_id"] == a.run["mesh_id"], st
        assert st["node_id"] == b.run["node_id"]  # same node key, new mesh
        b.stop()
        # The same one-use token again, now on a third solo node: refused, exit 1, its mesh untouched.
        c = start_node(tmp_path / "c")
        genesis_before = (tmp_path / "c" / "genesis.json").read_bytes()
        c.stop()
        c = start_node(tmp_path / "c", "--join", token, wait=False)
        nodes.append(c)
        assert c.proc.wait(timeout=30) == 1
        assert "used up" in c.stderr()
        assert (tmp_path / "c" / "genesis.json").read_bytes() == genesis_before
    finally:
        for n in reversed(nodes):
            n.stop()
