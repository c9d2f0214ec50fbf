"""Expert RPC timeouts as user settings: ``--experts-{connect,message,layer}-timeout`` and the same
config-file keys, carried from ``DaemonConfig`` into each coordinator's ``CoordinatorConfig`` and shown in
``meshd status --json``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import meshd_cmd, meshd_env
from daemon_testlib import start_node
from experts_util import make_moe_checkpoint
from test_experts_service import _FakeTransport

from engine.experts.channel import LoopThread
from engine.experts.coordinator import CoordinatorConfig
from engine.tiny import create_tiny
from meshd.cli import build_parser
from meshd.config import DaemonConfig, load_config
from meshd.errors import UsageError
from meshd.experts_service import ExpertsService

ENV = {"HOME": "/home/someone"}


def _load(argv: list[str], role: str = "serve") -> DaemonConfig:
    return load_config(build_parser().parse_args([role, *argv]), ENV, role)


def _timeouts(cfg: DaemonConfig) -> tuple[float, float, float]:
    return cfg.experts_connect_timeout_s, cfg.experts_message_timeout_s, cfg.experts_layer_timeout_s


def test_defaults_are_the_coordinators() -> None:
    base = CoordinatorConfig()
    assert _timeouts(_load([])) == (base.connect_timeout_s, base.message_timeout_s, base.layer_timeout_s)
    assert _timeouts(_load([])) == (5.0, 10.0, 30.0)


def test_flags_set_the_timeouts() -> None:
    cfg = _load(["--experts-connect-timeout", "1.5", "--experts-message-timeout", "2",
                 "--experts-layer-timeout", "2"])  # message == layer is allowed
    assert _timeouts(cfg) == (1.5, 2.0, 2.0)


def test_file_takes_ints_or_floats_and_flags_beat_it(tmp_path: Path) -> None:
    conf = tmp_path / "meshd.toml"
    conf.write_text("experts_connect_timeout = 2\nexperts-message-timeout = 2.5\n"
                    "experts-layer-timeout = 20\n")
    cfg = _load(["--config", str(conf)])
    assert _timeouts(cfg) == (2.0, 2.5, 20.0)
    assert all(type(t) is float for t in _timeouts(cfg))
    cfg = _load(["--config", str(conf), "--experts-message-timeout", "4", "--experts-layer-timeout", "8"])
    assert _timeouts(cfg) == (2.0, 4.0, 8.0)  # the connect timeout is still the file's


@pytest.mark.parametrize("flag", ["--experts-connect-timeout", "--experts-message-timeout",
                                  "--experts-layer-timeout"])
@pytest.mark.parametrize("value, match", [
    ("0", "more than 0"), ("-1", "more than 0"), ("nan", "more than 0"), ("inf", "more than 0"),
    ("1e10", "at most 86400"), ("abc", "expected a number of seconds"), ("", "expected a number of seconds"),
])
def test_bad_flag_values_name_the_flag(flag: str, value: str, match: str) -> None:
    with pytest.raises(UsageError, match=f"^{flag}: .*{match}") as e:
        _load([flag, value])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, content, match", [
    (["--experts-message-timeout", "31"], "", r"^--experts-message-timeout = 31 s exceeds "
                                              r"--experts-layer-timeout \(default\) = 30 s"),
    (["--experts-layer-timeout", "9.5"], "", r"^--experts-message-timeout \(default\) = 10 s exceeds "
                                             r"--experts-layer-timeout = 9.5 s"),
    (["--experts-message-timeout", "6"], "experts-layer-timeout = 5\n",
     r"^--experts-message-timeout = 6 s exceeds config file .*: experts-layer-timeout = 5 s"),
])
def test_message_timeout_above_layer_timeout_is_refused(tmp_path: Path, argv: list[str], content: str,
                                                        match: str) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(content)
    with pytest.raises(UsageError, match=match):
        _load(["--config", str(conf), *argv])


@pytest.mark.parametrize("content, match", [
    ("experts-layer-timeout = true\n", "'experts-layer-timeout' must be a number"),
    ('experts-connect-timeout = "5"\n', "'experts-connect-timeout' must be a number"),
    ("experts-message-timeout = 0\n", "experts-message-timeout: must be more than 0"),
    ("experts-message-timeout = -0.5\n", "experts-message-timeout: must be more than 0"),
    ("experts-connect-timeout = inf\n", "experts-connect-timeout: must be more than 0"),
    ("experts-connect-timeout = nan\n", "experts-connect-timeout: must be more than 0"),
    ("experts-message-timeout = 40\n", "experts-message-timeout = 40 s exceeds"),
])
def test_bad_file_values_name_the_key(tmp_path: Path, content: str, match: str) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(content)
    with pytest.raises(UsageError, match=f"^config file {conf}: .*{match}"):
        _load(["--config", str(conf)])


def test_client_ignores_the_timeout_keys_with_a_note(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text("experts-layer-timeout = 0\n")  # would be refused by `serve`
    cfg = _load(["--config", str(conf)], role="client")
    assert _timeouts(cfg) == (5.0, 10.0, 30.0)
    assert any("'experts-layer-timeout' ignored" in n for n in cfg.notes)


@pytest.mark.parametrize("content, flags, match", [
    ("", ["--experts-message-timeout", "0"], "meshd: --experts-message-timeout: must be more than 0"),
    ("experts-layer-timeout = 2\n", ["--experts-message-timeout", "2.5"],
     "meshd: --experts-message-timeout = 2.5 s exceeds config file "),
])
def test_bad_timeout_process_exits_2_with_one_line_before_any_state(tmp_path: Path, content: str,
                                                                     flags: list[str], match: str) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(content)
    state = tmp_path / "s"
    argv = meshd_cmd("serve", "--config", str(conf), "--state-dir", str(state), "--no-mdns", "--listen",
                     "127.0.0.1:0", "--api", "127.0.0.1:0", "--remote-experts", "prefer", *flags)
    out = subprocess.run(argv, env=meshd_env(), capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith(match), out.stderr
    assert not state.exists()


def test_service_hands_the_timeouts_to_each_coordinator(tmp_path: Path) -> None:
    ck = make_moe_checkpoint(tmp_path / "m", layers=2, experts=4)
    cfg = _load(["--remote-experts", "prefer", "--experts-connect-timeout", "1.25",
                 "--experts-message-timeout", "2.5", "--experts-layer-timeout", "7"])
    svc = ExpertsService.from_config(cfg)
    lt = LoopThread()
    try:
        lt.run(svc.start(_FakeTransport()))
        ex = lt.run(svc.coordinator(ck, None))
        got = ex.config
        assert (got.mode, got.connect_timeout_s, got.message_timeout_s, got.layer_timeout_s) == (
            "prefer", 1.25, 2.5, 7.0)
        assert svc.status()["timeouts"] == {"connect_s": 1.25, "message_s": 2.5, "layer_s": 7.0}
    finally:
        lt.run(svc.stop())
        lt.stop()


def test_worker_only_status_has_no_timeouts() -> None:
    assert "timeouts" not in ExpertsService.from_config(_load(["--experts", "/m"])).status()


def test_daemon_reports_the_effective_timeouts(tmp_path: Path) -> None:
    ck = create_tiny(tmp_path / "ck")  # a small MoE checkpoint with the tokenizer `--model PATH` needs
    conf = tmp_path / "meshd.toml"
    conf.write_text("experts-connect-timeout = 3\nexperts-layer-timeout = 12.5\n")
    node = start_node(tmp_path / "c", "--config", str(conf), "--model", str(ck), "--remote-experts", "prefer",
                      "--experts-message-timeout", "2.5")
    try:
        experts = node.status()["services"]["experts"]
        assert experts["timeouts"] == {"connect_s": 3.0, "message_s": 2.5, "layer_s": 12.5}
        assert [c["mode"] for c in experts["coordinators"]] == ["prefer"]  # the model got a coordinator
    finally:
        node.stop()
