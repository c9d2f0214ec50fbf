"""Config: flags, TOML file and environment merged into DaemonConfig; every bad value is exit 2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import meshd_cmd, meshd_env

from meshd.cli import build_parser
from meshd.config import HostPort, is_loopback, load_config, parse_hostport
from meshd.errors import UsageError

ENV = {"HOME": "/home/someone"}


def _load(argv: list[str], env: dict[str, str] | None = None, role: str = "serve"):
    args = build_parser().parse_args([role, *argv])
    return load_config(args, ENV if env is None else env, role)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0.0.0.0:9336", HostPort("0.0.0.0", 9336)),
        ("127.0.0.1:0", HostPort("127.0.0.1", 0)),
        ("[::1]:9337", HostPort("::1", 9337)),
        ("localhost:65535", HostPort("localhost", 65535)),
        ("node-1.example.org:1", HostPort("node-1.example.org", 1)),
    ],
)
def test_parse_hostport_accepts(text: str, expected: HostPort) -> None:
    assert parse_hostport(text, "--listen") == expected
    assert str(expected) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "9336",
        ":9336",
        "host:",
        "host:65536",
        "host:-1",
        "host:12a",
        "::1:9336",
        "[::1]9336",
        "[nothost]:1",
        "bad host:1",
        "a_b:1",
        "[::1:1",
    ],
)
def test_parse_hostport_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="--listen"):
        parse_hostport(text, "--listen")


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.9.9.9") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    assert not is_loopback("myhost")


def test_defaults() -> None:
    cfg = _load([])
    assert cfg.listen == HostPort("0.0.0.0", 9336) and cfg.api == HostPort("127.0.0.1", 9337)
    assert cfg.state_dir == Path("/home/someone/.local/state/meshd")
    assert cfg.mesh_name == "meshd" and cfg.mdns and cfg.remote_experts == "off"
    assert cfg.join_token is None and cfg.join_file is None and cfg.models == ()


def test_file_keys_with_dashes_or_underscores_and_flags_override(tmp_path: Path) -> None:
    conf = tmp_path / "meshd.toml"
    conf.write_text(
        'listen = "127.0.0.1:7000"\napi = "127.0.0.1:7001"\nremote_experts = "prefer"\n'
        'mesh-name = "home"\nno_mdns = true\nmodel = ["tiny", "q=/models/q"]\nexperts = "/m@0-1/0-3"\n'
        'log-level = "DEBUG"\nstate-dir = "state"\n'
    )
    cfg = _load(["--config", str(conf)])
    assert cfg.listen == HostPort("127.0.0.1", 7000) and cfg.api == HostPort("127.0.0.1", 7001)
    assert cfg.remote_experts == "prefer" and cfg.mesh_name == "home" and not cfg.mdns
    assert cfg.models == ("tiny", "q=/models/q") and cfg.experts == ("/m@0-1/0-3",)
    assert cfg.log_level == "debug"
    assert cfg.state_dir == tmp_path / "state"  # relative to the file's directory
    cfg = _load(
        [
            "--config",
            str(conf),
            "--listen",
            "127.0.0.1:8000",
            "--remote-experts",
            "on",
            "--model",
            "other",
            "--state-dir",
            "/x",
        ]
    )
    assert cfg.listen == HostPort("127.0.0.1", 8000) and cfg.remote_experts == "on"
    assert cfg.models == ("other",) and cfg.state_dir == Path("/x")
    assert cfg.api == HostPort("127.0.0.1", 7001)  # not overridden: still the file's


def test_state_dir_order_flag_file_env(tmp_path: Path) -> None:
    env = {"HOME": "/h", "MESHD_STATE_DIR": "/m", "STATE_DIRECTORY": "/s:/t"}
    assert _load([], env).state_dir == Path("/m")
    assert _load([], {"HOME": "/h", "STATE_DIRECTORY": "/s:/t"}).state_dir == Path("/s")
    conf = tmp_path / "c.toml"
    conf.write_text('state-dir = "/f"\n')
    assert _load(["--config", str(conf)], env).state_dir == Path("/f")
    assert _load(["--config", str(conf), "--state-dir", "/flag"], env).state_dir == Path("/flag")


def test_join_sources(tmp_path: Path) -> None:
    token_file = tmp_path / "join.token"
    token_file.write_text("meshd1fromfile\n")
    token_file.chmod(0o600)  # a join file others can read is refused
    assert _load([], {**ENV, "MESHD_JOIN": "meshd1env"}).join_token == "meshd1env"
    cfg = _load([], {**ENV, "MESHD_JOIN_FILE": str(token_file)})
    assert cfg.join_token is None and cfg.read_join_token() == "meshd1fromfile"
    token_file.write_text("meshd1changed")  # re-read on every call
    assert cfg.read_join_token() == "meshd1changed"
    # the flag beats the environment
    cfg = _load(["--join", "meshd1flag"], {**ENV, "MESHD_JOIN_FILE": str(token_file)})
    assert cfg.join_token == "meshd1flag" and cfg.join_file is None
    assert "meshd1flag" not in repr(cfg)  # the token never shows in a repr (or a log of the config)


@pytest.mark.parametrize(
    "argv, env, match",
    [
        (["--join", "notatoken"], {}, "meshd1"),
        (["--join", ""], {}, "empty"),
        ([], {"MESHD_JOIN": "meshd1a", "MESHD_JOIN_FILE": "/x"}, "not both"),
        (["--api", "0.0.0.0:9337"], {}, "without an API key"),
        (["--api", "[::]:9337"], {}, "without an API key"),
        (["--api-key-file", "/nonexistent/keys"], {}, "not a readable file"),
        (["--log-level", "loud"], {}, "--log-level"),
        (["--mesh-name", "x" * 65], {}, "mesh name"),
        (["--model", " "], {}, "empty SPEC"),
    ],
)
def test_bad_values_raise_usage_error(argv: list[str], env: dict[str, str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        _load(argv, {**ENV, **env})


def test_non_loopback_api_with_key_file_is_allowed(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-test\n")
    keys.chmod(0o600)
    cfg = _load(["--api", "0.0.0.0:9337", "--api-key-file", str(keys)])
    assert cfg.api == HostPort("0.0.0.0", 9337) and cfg.api_key_file == keys


def test_client_ignores_serve_only_keys_with_a_note(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('model = "tiny"\nlisten = "127.0.0.1:1"\n')
    cfg = _load(["--config", str(conf)], role="client")
    assert cfg.role == "client" and cfg.models == ()
    assert any("'model' ignored" in n for n in cfg.notes)


@pytest.mark.parametrize(
    "content, match",
    [
        ("listen = 9336\n", "'listen' must be a string"),
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("listen = \n", "config file"),
        ("model = [1, 2]\n", "list of strings"),
        ('no-mdns = "yes"\n', "must be a bool"),
        ('listen = "a"\nlisten = "b"\n', "config file"),
        ('listen = "x"\nlisten_x = 1\n', "unknown key"),
        ('join = "meshd1a"\njoin-file = "/t"\n', "not both"),
        ('log-format = "xml"\n', "json or pretty"),
        ('listen = "1.2.3.4:99999"\n', "port must be"),
    ],
)
def test_bad_config_file_raises_usage_error(tmp_path: Path, content: str, match: str) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(content)
    with pytest.raises(UsageError, match=match):
        _load(["--config", str(conf)])


def test_missing_config_file() -> None:
    with pytest.raises(UsageError, match="No such file"):
        _load(["--config", "/nonexistent/meshd.toml"])


@pytest.mark.parametrize(
    "content, extra",
    [
        ("bogus = 1\n", []),
        ("listen = [\n", []),
        ('api = "0.0.0.0:9337"\n', []),
        ('listen = "nope"\n', []),
        ("", ["--log-format", "xml"]),  # argparse's own error: also one line, exit 2
    ],
)
def test_bad_config_process_exits_2_with_one_line(tmp_path: Path, content: str, extra: list[str]) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(content)
    out = subprocess.run(
        meshd_cmd("serve", "--config", str(conf), "--state-dir", str(tmp_path / "s"), "--no-mdns", *extra),
        env=meshd_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 2
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("meshd: ") and out.stdout == ""
    assert not (tmp_path / "s").exists()  # nothing created before the config was valid


@pytest.mark.parametrize("flags", [["--model", "/nonexistent/ckpt"], ["--model", "openai:notaurl"],
                                   ["--experts", "/nonexistent/ckpt@0-1/0-3"], ["--stage", "/nonexistent/ckpt"],
                                   ["--stage", "tiny@3-1"], ["--model", "tiny", "--model", "tiny"],
                                   ["--stage", "tiny@0-1", "--stage", "tiny@2-3"],
                                   ["--model", "a=tiny", "--model", f"a={Path(__file__).parent}"],
                                   ["--pipeline-memory", "-1"], ["--pipeline-memory", "nan"]])
def test_bad_model_or_experts_spec_is_exit_2_before_any_state_is_written(tmp_path: Path, flags: list[str]) -> None:
    state = tmp_path / "s"
    out = subprocess.run(meshd_cmd("serve", "--state-dir", str(state), "--no-mdns", "--listen", "127.0.0.1:0",
                                   "--api", "127.0.0.1:0", *flags), env=meshd_env(), capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("meshd: --")
    assert not (state / "genesis.json").exists() and not (state / "identity.key").exists()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """tiny (4 layers, dense none, 8 experts) as a directory and as a Q8_0 GGUF file."""
    from engine.gguf_export import export_gguf
    from engine.tiny import create_tiny

    d = create_tiny(tmp_path_factory.mktemp("ck") / "ck")
    g = d.parent / "ck.gguf"
    export_gguf(d, g, "Q8_0")
    return d, g


@pytest.mark.parametrize(("flag", "suffix", "says", "form"), [
    ("--stage", "@2-5", "the model has layers 0-3", 0),
    ("--stage", "@2-5", "the model has layers 0-3", 1),
    ("--experts", "@0-4/0-3", "layer 4 does not exist", 0),
    ("--experts", "@0-3/6-8", "expert 8 does not exist", 1),
])
def test_ranges_a_checkpoint_lacks_are_exit_2_before_any_state_is_written(
    tmp_path: Path, tiny_files: tuple[Path, Path], flag: str, suffix: str, says: str, form: int
) -> None:
    # refused with the same words before, but only after the node had made its key and founded a mesh
    # (or redeemed its invite token): a user's typo left a mesh behind
    state = tmp_path / "s"
    out = subprocess.run(meshd_cmd("serve", "--state-dir", str(state), "--no-mdns", "--listen", "127.0.0.1:0",
                                   "--api", "127.0.0.1:0", flag, f"{tiny_files[form]}{suffix}"),
                         env=meshd_env(), capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith(f"meshd: {flag} ") and says in out.stderr, out.stderr
    assert not state.exists()


def test_pipeline_flags_and_file_keys(tmp_path: Path) -> None:
    cfg = _load([])
    assert cfg.stages == () and cfg.pipeline == "off" and cfg.pipeline_memory_mb == 0
    conf = tmp_path / "meshd.toml"
    conf.write_text('stage = ["/m@0-3", "tiny"]\npipeline = "prefer"\npipeline-memory = 512.5\n')
    cfg = _load(["--config", str(conf)])
    assert cfg.stages == ("/m@0-3", "tiny") and cfg.pipeline == "prefer" and cfg.pipeline_memory_mb == 512.5
    cfg = _load(["--config", str(conf), "--pipeline", "on", "--stage", "/x", "--pipeline-memory", "64"])
    assert cfg.stages == ("/x",) and cfg.pipeline == "on" and cfg.pipeline_memory_mb == 64
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for flag, default in (("--stage", "default none"), ("--pipeline ", "default off"), ("--pipeline-memory", "default 0")):
        assert flag in help_text and default in " ".join(help_text.split()), flag


def _doc_keys(text: str) -> set[str]:
    """Keys set (or shown commented out) in a TOML example."""
    import re

    return {m.group(1).replace("_", "-") for m in re.finditer(r"^#?\s*([a-z][a-z_-]*)\s*=", text, re.MULTILINE)}


def test_config_examples_name_every_key_and_load(tmp_path: Path) -> None:
    """docs/daemon.md's example and systemd/meshd.toml show every config key `meshd serve` takes, and the
    example loads (with local paths) through the real loader."""
    import re

    root = Path(__file__).resolve().parent.parent
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {a.option_strings[-1][2:] for a in serve._actions
             if a.option_strings and a.option_strings[-1].startswith("--")}
    flags -= {"help", "config", "join"}  # --join's token belongs in a join file, not in a config file
    doc = re.search(r"```toml\n(.*?)```", (root / "docs" / "daemon.md").read_text(), re.DOTALL)
    assert doc is not None
    assert sorted(flags - _doc_keys(doc.group(1))) == []
    unit_keys = _doc_keys((root / "systemd" / "meshd.toml").read_text())
    assert sorted(flags - unit_keys - {"state-dir", "join-file"}) == []  # the unit sets those itself
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    keys.chmod(0o600)
    example = doc.group(1).replace("/etc/meshd/api-keys", str(keys))
    example = example.replace("qwen=/srv/models/qwen3-30b-a3b", "b=tiny")
    conf = tmp_path / "meshd.toml"
    conf.write_text(example)
    cfg = _load(["--config", str(conf)])
    assert cfg.pipeline == "off" and cfg.remote_experts == "off" and cfg.experts_poll_s == 0.002
