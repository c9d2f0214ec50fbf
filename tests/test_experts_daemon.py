"""``meshd serve --experts`` as a real daemon process: start validation, status, and bit-exact serving."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import meshd_cmd, meshd_env
from daemon_testlib import start_node
from experts_mesh import Coordinator, MeshFixture
from experts_util import make_moe_checkpoint
from safetensors.numpy import load_file, save_file
from test_experts_parity import gate

from engine.experts.fingerprint import model_fingerprint
from engine.model import Model
from meshd.state import StateDir


def _provision(mesh: MeshFixture, state: Path) -> str:
    """A state dir holding a node key and credentials of the test's mesh; returns the node id."""
    sd = StateDir(state)
    sd.ensure()
    ident, _ = sd.load_or_create_identity()
    sd.store_credentials(mesh.member(ident))
    return ident.node_id


def _serve_fails(tmp: Path, spec: str) -> str:
    out = subprocess.run(meshd_cmd("serve", "--state-dir", str(tmp / "s"), "--no-mdns", "--listen", "127.0.0.1:0",
                                   "--api", "127.0.0.1:0", "--experts", spec),
                         env=meshd_env(), capture_output=True, timeout=60)
    assert out.returncode == 2, out.stderr.decode()[-2000:]
    err = out.stderr.decode()
    assert "Traceback" not in err
    return err


def test_bad_expert_shards_fail_the_start_naming_them(tmp_path: Path) -> None:
    ck = make_moe_checkpoint(tmp_path / "m", dense_layers=(1,))
    err = _serve_fails(tmp_path, f"{ck}@1/0-7")
    assert "layer 1 is dense" in err
    t = load_file(str(ck / "model.safetensors"))
    del t["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(t, str(ck / "model.safetensors"))
    err = _serve_fails(tmp_path, str(ck))
    assert "missing expert tensor model.layers.2.mlp.experts.5.down_proj.weight" in err
    err = _serve_fails(tmp_path, "tiny@0-99/0-3")  # named as the user wrote it, not the state dir's path
    assert "meshd: --experts tiny@0-99/0-3: layer 4 does not exist" in err, err[-500:]


def test_daemon_worker_serves_bit_exact_and_reports_status(tmp_path: Path) -> None:
    mesh = MeshFixture()
    ck = make_moe_checkpoint(tmp_path / "q3", family="qwen3_moe", layers=2, experts=8, seed=4)
    node_id = _provision(mesh, tmp_path / "w")
    node = start_node(tmp_path / "w", "--experts", str(ck))
    coord = Coordinator(mesh)
    try:
        host, _, port = node.run["quic"].rpartition(":")
        coord.lt.run(coord.transport.connect((host, int(port)), node_id), timeout=15)
        ex = coord.executor(ck, "on")
        assert list(ex.links) == [node_id]
        model = Model.load(ck)
        assert gate(model, ex, [3, 1, 4, 1, 5]) == []
        st = node.status()
        worker = st["services"]["experts"]["worker"]
        assert worker["requests"] > 0 and worker["shards"][0]["fingerprint"] == model_fingerprint(ck).hex()
        assert ex.status()["workers"][node_id]["calls"] > 0  # type: ignore[index]
    finally:
        coord.close()
        node.stop()


def test_daemon_worker_refuses_another_checkpoint_by_name(tmp_path: Path) -> None:
    mesh = MeshFixture()
    mine = make_moe_checkpoint(tmp_path / "mine", seed=1)
    theirs = make_moe_checkpoint(tmp_path / "theirs-ckpt", seed=2)
    node_id = _provision(mesh, tmp_path / "w")
    node = start_node(tmp_path / "w", "--experts", str(theirs))
    coord = Coordinator(mesh)
    try:
        host, _, port = node.run["quic"].rpartition(":")
        coord.lt.run(coord.transport.connect((host, int(port)), node_id), timeout=15)
        ex = coord.executor(mine, "on")
        assert ex.links == {}
        refused = coord.service.status()["coordinators"][0]["refused"]
        assert "theirs-ckpt" in refused[node_id] and "different checkpoint" in refused[node_id]
    finally:
        coord.close()
        node.stop()


def test_a_plain_member_is_not_listed_as_a_worker(tmp_path: Path) -> None:
    """A connected member that serves no expert stream is no worker: no row with errors, no refusal (before:
    a worker row with an error per probe and "refused: no hello answer (stream reset ... code 20)")."""
    mesh = MeshFixture()
    ck = make_moe_checkpoint(tmp_path / "q3", layers=2, experts=4)
    node_id = _provision(mesh, tmp_path / "p")
    node = start_node(tmp_path / "p")  # serves nothing, holds no experts
    coord = Coordinator(mesh)
    try:
        host, _, port = node.run["quic"].rpartition(":")
        coord.lt.run(coord.transport.connect((host, int(port)), node_id), timeout=15)
        ex = coord.executor(ck, "on")
        coord.lt.run(coord.service.probe_all())  # a second round: still not counted
        st = coord.service.status()["coordinators"][0]
        assert ex.links == {} and st["refused"] == {} and st["loading"] == {} and node_id not in st["workers"], st
        assert ex.unavailable_reason() == "no expert workers hold this model's routed experts"
    finally:
        coord.close()
        node.stop()


@pytest.mark.parametrize("mode", ["on", "prefer"])
def test_remote_experts_flag_starts_the_service(tmp_path: Path, mode: str) -> None:
    node = start_node(tmp_path / "c", "--remote-experts", mode)
    try:
        assert "experts" in node.status()["services"]
    finally:
        node.stop()


def test_experts_tiny_uses_the_state_dirs_tiny_checkpoint(tmp_path: Path) -> None:
    from engine.tiny import create_tiny

    node = start_node(tmp_path / "w", "--experts", "tiny@0-1/0-3")
    try:
        shard = node.status()["services"]["experts"]["worker"]["shards"][0]
        assert shard["layers"] == [0, 1] and shard["experts"] == [0, 1, 2, 3]
        # Deterministic: any node's `tiny` has the same fingerprint, so `--model tiny` coordinators match.
        assert shard["fingerprint"] == model_fingerprint(create_tiny(tmp_path / "t", "qwen3_moe", 0)).hex()
    finally:
        node.stop()
