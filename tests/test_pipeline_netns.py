"""A pipeline across a real link: the stage node in its own network namespace behind a veth pair (with a
netem delay where the kernel has it), the serving node in this namespace on the veth address (API on
loopback). The stage is killed mid-stream and the serving node, which has room, takes its layers back."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("meshd.membership.service")

from conftest import meshd_cmd, meshd_env
from daemon_testlib import Node, start_node
from pipeline_mesh import (
    collect,
    invite,
    pipeline_status,
    post,
    stream,
    wait_for,
    wait_plan,
    whole,
)

DELAY_MS = 2  # each way: a round trip of ~4 ms


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture()
def link() -> Iterator[tuple[str, str, str, bool]]:
    """(namespace, address here, address there, netem delay on); deleted afterwards."""
    ok = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
    if not ok or subprocess.run(["ip", "netns", "list"], check=False, capture_output=True).returncode != 0:
        pytest.skip("needs root, ip netns and tc")
    tag = os.getpid() % 100000
    ns, here_if = f"pipeline-b{tag}", f"pipeline-r{tag}"
    net = f"10.116.{tag % 250}"
    try:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", here_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{net}.1/24", "dev", here_if)
        _ip("link", "set", here_if, "up")
        _ip("-n", ns, "addr", "add", f"{net}.2/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        delayed = (
            subprocess.run(
                ["tc", "qdisc", "add", "dev", here_if, "root", "netem", "delay", f"{DELAY_MS}ms"],
                capture_output=True,
            ).returncode
            == 0
        )  # netem may not be in this kernel
        if delayed:
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "eth0",
                    "root",
                    "netem",
                    "delay",
                    f"{DELAY_MS}ms",
                ],
                check=True,
            )
        yield ns, f"{net}.1", f"{net}.2", delayed
    finally:
        subprocess.run(["ip", "link", "del", here_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _start_in(ns: str, state: Path, *args: str) -> Node:
    state.mkdir(parents=True, exist_ok=True)
    err = state.parent / f"{state.name}.stderr"
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                *meshd_cmd(
                    "serve",
                    "--state-dir",
                    str(state),
                    "--no-mdns",
                    "--api",
                    "127.0.0.1:0",
                    "--log-format",
                    "json",
                    *args,
                ),
            ],
            env=meshd_env(),
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    node = Node(proc, state, err)
    node.wait_ready()
    return node


BODY = (
    "/v1/completions",
    {
        "model": "tiny",
        "prompt": "The mesh holds",
        "max_tokens": 400,
        "logprobs": 1,
        "temperature": 0.7,
        "seed": 6,
    },
)


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_stage_across_a_link_byte_identical_and_recovered_here_after_kill(
    link: tuple[str, str, str, bool], tmp_path: Path
) -> None:
    ns, here, there, delayed = link
    ref = start_node(tmp_path / "ref", "--model", "tiny")
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--listen", f"{here}:0")
    nodes = [ref, srv]
    try:
        st = _start_in(
            ns,
            tmp_path / "a",
            "--listen",
            f"{there}:0",
            "--stage",
            "tiny@2-3",
            "--join",
            invite(tmp_path / "s"),
        )
        nodes.append(st)
        wait_plan(srv, [[0, 1], [2, 3]])
        short = (BODY[0], {**BODY[1], "max_tokens": 12})
        code, want = post(ref.run["api"], *short)
        code2, got = post(srv.run["api"], *short)
        assert code == code2 == 200 and whole(got, "completion") == whole(want, "completion")
        s = pipeline_status(srv)
        lk = s["runs"][s["run"]]["stages"][0]
        assert lk["calls"] > 0 and lk["rtt_ms"] is not None, lk
        if delayed:  # every hop crosses the delayed link
            assert lk["latency_ms_avg"] >= 2 * DELAY_MS and lk["rtt_ms"] >= 2 * DELAY_MS, lk
        wait_for(lambda: (st.state_dir / "peers.json").exists(), 20, "peers remembered")
        code, want = post(ref.run["api"], *BODY)
        assert code == 200
        events: list[dict[str, Any]] = []
        for ev in stream(srv.run["api"], *BODY):
            events.append(ev)
            if len(events) == 10:
                st.proc.send_signal(signal.SIGKILL)  # `ip netns exec` execs meshd: this is the daemon
        assert st.proc.wait(timeout=5) == -signal.SIGKILL
        # this node has room for every layer: the sequence is replayed here and goes on, same bytes
        assert "error" not in events[-1], events[-1]
        assert collect(events, "completion") == whole(want, "completion")
        s = pipeline_status(srv)
        assert s["recoveries"] == 1 and s["plan"] == [{"node_id": srv.run["node_id"], "layers": [0, 3]}], s
    finally:
        for n in reversed(nodes):
            n.stop()
