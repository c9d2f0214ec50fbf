"""Daemon configuration: flags, a TOML file, and environment variables merged into one ``DaemonConfig``.

Precedence, per setting: command-line flag, then the config file (its keys are the long flags, with
``-`` or ``_``), then the environment (``MESHD_STATE_DIR``/``STATE_DIRECTORY`` for the state dir,
``MESHD_JOIN``/``MESHD_JOIN_FILE`` for the join token), then the default. The file is "flags written down",
so it sits just below the command line. Relative paths in the file are relative to the file's directory.

Every problem raises ``UsageError`` (exit 2) with one line naming the setting and, for the file, where.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from meshd.errors import UsageError
from meshd.state import resolve_state_dir
from transport.config import is_loopback_host
from transport.credentials import MAX_MESH_NAME_CHARS
from engine.limits import EXPERT_MAX_POLL_S, EXPERT_POLL_S

DEFAULT_LISTEN = "0.0.0.0:9336"
DEFAULT_API = "127.0.0.1:9337"
DEFAULT_MESH_NAME = "meshd"
TOKEN_PREFIX = "meshd1"
MAX_CONFIG_FILE_BYTES = 1 << 20  # a config file is a few hundred bytes; refuse to parse anything huge
MAX_JOIN_FILE_BYTES = 16 << 10  # an invite token is well under 1 KiB
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("json", "pretty")
REMOTE_EXPERTS = ("off", "on", "prefer")
# Expert RPC timeouts (seconds), the defaults of engine.experts.coordinator.CoordinatorConfig.
DEFAULT_EXPERTS_CONNECT_TIMEOUT_S = 5.0
DEFAULT_EXPERTS_MESSAGE_TIMEOUT_S = 10.0
DEFAULT_EXPERTS_LAYER_TIMEOUT_S = 30.0
MAX_EXPERTS_TIMEOUT_S = 86400.0  # a day: longer is a hung request, and threading waits overflow past ~9e9 s
ROLES = ("serve", "client")

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?$")


class HostPort(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return format_hostport(self.host, self.port)


def format_hostport(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_hostport(text: str, what: str) -> HostPort:
    """Parse ``HOST:PORT`` or ``[V6]:PORT`` (port 0 = ephemeral). Raises ``UsageError`` naming ``what``."""
    if not isinstance(text, str) or not text:
        raise UsageError(f"{what}: expected HOST:PORT")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise UsageError(f"{what}: expected [IPV6]:PORT, got {text!r}")
        host, port_text = text[1:end], text[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(f"{what}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise UsageError(f"{what}: expected HOST:PORT, got {text!r}")
        if ":" in host:
            raise UsageError(f"{what}: write IPv6 addresses in brackets, e.g. [::1]:9336")
        if not _HOSTNAME.match(host):
            raise UsageError(f"{what}: {host!r} is not a host name or address")
    if not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"{what}: port must be 0..65535, got {port_text!r}")
    return HostPort(host, int(port_text))


def is_loopback(host: str) -> bool:
    """True for loopback addresses (``[::1]`` and ``::ffff:127.0.0.1`` too, see
    ``transport.config.is_loopback_host``) and ``localhost``; hostnames are not resolved (so they count as
    not)."""
    host = host.strip("[]")
    return host.rstrip(".").lower() == "localhost" or is_loopback_host(host)


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``meshd serve``/``meshd client`` was asked to do, validated."""

    role: str
    state_dir: Path
    listen: HostPort
    api: HostPort
    models: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    remote_experts: str = "off"
    experts_connect_timeout_s: float = DEFAULT_EXPERTS_CONNECT_TIMEOUT_S  # transport connect + stream + hello
    experts_message_timeout_s: float = DEFAULT_EXPERTS_MESSAGE_TIMEOUT_S  # one expert request until its reply
    experts_layer_timeout_s: float = DEFAULT_EXPERTS_LAYER_TIMEOUT_S  # one sparse layer, retries included
    experts_poll_s: float = EXPERT_POLL_S  # polling for expert replies / the next request (0: off)
    stages: tuple[str, ...] = ()  # --stage PATH[@FIRST-LAST]: layers offered as a pipeline stage
    pipeline: str = "off"  # --pipeline off|on|prefer: split served models' layers over stage nodes
    pipeline_memory_mb: float = 0.0  # memory offered for pipeline layers (0: what the machine has free)
    join_token: str | None = field(default=None, repr=False)  # a secret: never logged
    join_file: Path | None = None
    mesh_name: str = DEFAULT_MESH_NAME
    mdns: bool = True
    api_key_file: Path | None = None
    log_format: str = "json"
    log_level: str = "info"
    config_file: Path | None = None
    notes: tuple[str, ...] = ()  # things to log once logging is up (ignored keys etc.); no secrets
    shutdown_timeout_s: float = 4.0  # SPEC: clean stop within 5 s; leave a margin for the interpreter

    @property
    def has_join(self) -> bool:
        return self.join_token is not None or self.join_file is not None

    def read_join_token(self) -> str | None:
        """The invite token from ``join``/``join-file`` (re-read from the file on every call).

        Raises ``UsageError`` if the file is missing, empty or does not hold a meshd token.
        """
        if self.join_token is not None:
            return self.join_token
        if self.join_file is None:
            return None
        try:
            with open(self.join_file, "rb") as f:
                refuse_shared_file(os.fstat(f.fileno()).st_mode, self.join_file, "join file")
                raw = f.read(MAX_JOIN_FILE_BYTES + 1)
        except OSError as e:
            raise UsageError(f"join file {self.join_file}: {e.strerror}") from e
        if len(raw) > MAX_JOIN_FILE_BYTES:
            raise UsageError(f"join file {self.join_file} is too large to hold a token")
        try:
            token = raw.decode().strip()
        except UnicodeDecodeError:
            raise UsageError(f"join file {self.join_file} does not hold a meshd token") from None
        return _check_token(token, f"join file {self.join_file}")


def refuse_shared_file(mode: int, path: Path, what: str) -> None:
    """Refuse a secret file that group or others may read (as ``identity.key`` is). Raises ``UsageError``."""
    if mode & 0o077:
        raise UsageError(f"{what} {path} is readable by group or others (mode {mode & 0o7777:04o}); "
                         f"run: chmod 600 {path}")


def read_token_stdin(where: str) -> str:
    """The invite token from standard input (``--join -``, ``meshd join -``): its first line."""
    if sys.stdin is None or sys.stdin.isatty():
        sys.stderr.write("paste the invite token and press Enter: ")
        sys.stderr.flush()
    line = sys.stdin.readline(MAX_JOIN_FILE_BYTES + 1) if sys.stdin is not None else ""
    return _check_token(line, f"{where} (standard input)")


def _check_token(token: str, where: str) -> str:
    token = token.strip()
    if not token:
        raise UsageError(f"{where}: the invite token is empty")
    if not token.startswith(TOKEN_PREFIX):
        raise UsageError(f"{where}: not a meshd invite token (tokens start with {TOKEN_PREFIX!r})")
    return token


_NUMBER = (int, float)  # a TOML integer or float (never a bool, although bool is an int in Python)

# Config-file keys (the long flags) and the type each must have in TOML.
_FILE_KEYS: dict[str, tuple[type, ...]] = {
    "state-dir": (str,),
    "listen": (str,),
    "api": (str,),
    "model": (str, list),
    "experts": (str, list),
    "remote-experts": (str,),
    "experts-connect-timeout": _NUMBER,
    "experts-message-timeout": _NUMBER,
    "experts-layer-timeout": _NUMBER,
    "experts-poll": _NUMBER,
    "stage": (str, list),
    "pipeline": (str,),
    "pipeline-memory": _NUMBER,
    "join": (str,),
    "join-file": (str,),
    "mesh-name": (str,),
    "no-mdns": (bool,),
    "api-key-file": (str,),
    "log-format": (str,),
    "log-level": (str,),
}
_SERVE_ONLY = ("model", "experts", "remote-experts", "experts-connect-timeout", "experts-message-timeout",
               "experts-layer-timeout", "experts-poll", "stage", "pipeline", "pipeline-memory")


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse the TOML file into ``{flag-name: value}``. Raises ``UsageError`` with one line."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as e:
        raise UsageError(f"config file {path}: {e.strerror}") from e
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise UsageError(f"config file {path}: larger than {MAX_CONFIG_FILE_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode())
    except UnicodeDecodeError:
        raise UsageError(f"config file {path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file {path}: {str(e).splitlines()[0]}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("_", "-")
        if name not in _FILE_KEYS:
            known = ", ".join(sorted(_FILE_KEYS))
            raise UsageError(f"config file {path}: unknown key {key!r} (known: {known})")
        if name in out:
            raise UsageError(f"config file {path}: {key!r} is given twice")
        kinds = _FILE_KEYS[name]
        if (
            not isinstance(value, kinds)
            or (isinstance(value, bool) and bool not in kinds)
            or (isinstance(value, list) and not all(isinstance(v, str) for v in value))
        ):
            want = "number" if kinds == _NUMBER else " or ".join(
                "list of strings" if k is list else k.__name__.replace("str", "string") for k in kinds
            )
            raise UsageError(f"config file {path}: {key!r} must be a {want}")
        out[name] = value
    return out


def _seconds(value: Any, what: str) -> float:
    """A flag's text or a TOML number as seconds; ``UsageError`` naming ``what`` if it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{what}: expected a number of seconds, got {value!r}") from None


def parse_poll(value: Any, what: str) -> float:
    """Seconds of ``--experts-poll`` from a flag's text or a TOML number: 0 (off) to ``EXPERT_MAX_POLL_S``.

    Raises ``UsageError`` naming ``what``.
    """
    seconds = _seconds(value, what)
    if not 0 <= seconds <= EXPERT_MAX_POLL_S:  # also refuses nan and inf
        raise UsageError(f"{what}: must be 0 (off) to {EXPERT_MAX_POLL_S:g} seconds, got {value!r}")
    return seconds


def parse_timeout(value: Any, what: str) -> float:
    """Seconds from a flag's text or a TOML number: more than 0, at most ``MAX_EXPERTS_TIMEOUT_S``.

    Raises ``UsageError`` naming ``what``.
    """
    seconds = _seconds(value, what)
    if not 0 < seconds <= MAX_EXPERTS_TIMEOUT_S:  # also refuses nan and inf
        raise UsageError(
            f"{what}: must be more than 0 and at most {MAX_EXPERTS_TIMEOUT_S:g} seconds, got {value!r}"
        )
    return seconds


def _as_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def load_config(args: argparse.Namespace, env: Mapping[str, str], role: str) -> DaemonConfig:
    """Merge flags (``args``), the config file and ``env`` into a validated ``DaemonConfig``.

    Raises ``UsageError`` (exit 2) for any bad value, naming the setting.
    """
    if role not in ROLES:
        raise UsageError(f"unknown role {role!r}")
    notes: list[str] = []
    config_path = Path(args.config).expanduser() if getattr(args, "config", None) else None
    file: dict[str, Any] = read_config_file(config_path) if config_path else {}
    base = config_path.resolve().parent if config_path else Path.cwd()
    where = f"config file {config_path}" if config_path else ""

    def pick(flag: str) -> tuple[Any, str]:
        """(value, source description) from the flag, else the file; (None, "") if neither."""
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            return value, f"--{flag}"
        if flag in file:
            return file[flag], f"{where}: {flag}"
        return None, ""

    def pick_path(flag: str) -> tuple[Path | None, str]:
        value, source = pick(flag)
        if value is None:
            return None, ""
        if not value:
            raise UsageError(f"{source}: empty path")
        path = Path(value).expanduser()
        if source.startswith("config file") and not path.is_absolute():
            path = base / path
        return path, source

    if role == "client":
        for key in _SERVE_ONLY:
            if key in file:
                notes.append(f"config key {key!r} ignored: meshd client serves nothing")
                del file[key]

    state_flag, _ = pick_path("state-dir")
    state_dir = resolve_state_dir(str(state_flag) if state_flag else None, env)

    listen_text, source = pick("listen")
    listen = (
        parse_hostport(listen_text, source)
        if listen_text is not None
        else parse_hostport(DEFAULT_LISTEN, "default listen")
    )
    api_text, api_source = pick("api")
    api = (
        parse_hostport(api_text, api_source)
        if api_text is not None
        else parse_hostport(DEFAULT_API, "default api")
    )

    models = _as_list(pick("model")[0])
    experts = _as_list(pick("experts")[0])
    for spec, what in [(m, "model") for m in models] + [(e, "experts") for e in experts]:
        if not spec.strip():
            raise UsageError(f"--{what}: empty SPEC")

    stages = _as_list(pick("stage")[0])
    for spec in stages:
        if not spec.strip():
            raise UsageError("--stage: empty SPEC")
    pipeline, source = pick("pipeline")
    pipeline = pipeline if pipeline is not None else "off"
    if pipeline not in REMOTE_EXPERTS:
        raise UsageError(f"{source}: must be one of off, on, prefer, got {pipeline!r}")
    pipeline_mem, source = pick("pipeline-memory")
    try:
        pipeline_memory_mb = float(pipeline_mem) if pipeline_mem is not None else 0.0
    except ValueError:
        raise UsageError(f"{source}: must be a number of MB, got {pipeline_mem!r}") from None
    if not 0 <= pipeline_memory_mb < 1e12:  # also refuses nan and inf
        raise UsageError(f"{source}: must be 0 or more MB, got {pipeline_mem}")

    remote_experts, source = pick("remote-experts")
    remote_experts = remote_experts if remote_experts is not None else "off"
    if remote_experts not in REMOTE_EXPERTS:
        raise UsageError(f"{source}: must be one of {', '.join(REMOTE_EXPERTS)}, got {remote_experts!r}")

    def pick_timeout(flag: str, default: float) -> tuple[float, str]:
        """(seconds, source), the source reading ``--FLAG (default)`` when nothing set it."""
        value, source = pick(flag)
        return (default, f"--{flag} (default)") if value is None else (parse_timeout(value, source), source)

    connect_s, _ = pick_timeout("experts-connect-timeout", DEFAULT_EXPERTS_CONNECT_TIMEOUT_S)
    message_s, message_source = pick_timeout("experts-message-timeout", DEFAULT_EXPERTS_MESSAGE_TIMEOUT_S)
    layer_s, layer_source = pick_timeout("experts-layer-timeout", DEFAULT_EXPERTS_LAYER_TIMEOUT_S)
    poll_text, poll_source = pick("experts-poll")
    poll_s = EXPERT_POLL_S if poll_text is None else parse_poll(poll_text, poll_source)
    if message_s > layer_s:
        raise UsageError(f"{message_source} = {message_s:g} s exceeds {layer_source} = {layer_s:g} s "
                         "(a layer's timeout covers its messages and their retries)")

    # Join: the flag pair, else the file's pair, else the environment's pair; one of each pair at most.
    join_token: str | None = None
    join_file: Path | None = None
    if getattr(args, "join", None) is not None or getattr(args, "join_file", None) is not None:
        join_token = args.join
        join_file = Path(args.join_file).expanduser() if args.join_file is not None else None
        join_source = "--join" if join_token is not None else "--join-file"
        if join_token == "-":  # the safe way to pass a token by hand: not in /proc/PID/cmdline
            join_token = read_token_stdin("--join -")
    elif "join" in file or "join-file" in file:
        if "join" in file and "join-file" in file:
            raise UsageError(f"{where}: give 'join' or 'join-file', not both")
        join_token = file.get("join")
        join_file, _ = pick_path("join-file")
        join_source = f"{where}: join"
    else:
        env_token, env_file = env.get("MESHD_JOIN") or None, env.get("MESHD_JOIN_FILE") or None
        if env_token and env_file:
            raise UsageError("set MESHD_JOIN or MESHD_JOIN_FILE, not both")
        join_token = env_token
        join_file = Path(env_file).expanduser() if env_file else None
        join_source = "MESHD_JOIN"
    if join_token is not None:
        join_token = _check_token(join_token, join_source)

    mesh_name, source = pick("mesh-name")
    mesh_name = mesh_name if mesh_name is not None else DEFAULT_MESH_NAME
    if not 0 < len(mesh_name) <= MAX_MESH_NAME_CHARS or not mesh_name.isprintable():
        raise UsageError(f"{source}: mesh name must be 1..{MAX_MESH_NAME_CHARS} printable characters")

    no_mdns, _ = pick("no-mdns")
    api_key_file, key_source = pick_path("api-key-file")
    if api_key_file is not None and not api_key_file.is_file():
        raise UsageError(f"{key_source}: {api_key_file} is not a readable file")
    if api_key_file is not None:
        refuse_shared_file(api_key_file.stat().st_mode, api_key_file, f"{key_source}: API key file")
    if api_key_file is None and not is_loopback(api.host):
        raise UsageError(
            f"refusing to serve the API on non-loopback address {api} without an API key "
            "(pass --api-key-file FILE, or bind 127.0.0.1)"
        )

    log_format, source = pick("log-format")
    if log_format is None:
        log_format = "pretty" if sys.stderr.isatty() else "json"
    elif log_format not in LOG_FORMATS:
        raise UsageError(f"{source}: must be json or pretty, got {log_format!r}")
    log_level, source = pick("log-level")
    log_level = (log_level or "info").lower()
    if log_level == "warn":
        log_level = "warning"
    if log_level not in LOG_LEVELS:
        raise UsageError(f"{source}: must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")

    return DaemonConfig(
        role=role,
        state_dir=state_dir,
        listen=listen,
        api=api,
        models=models if role == "serve" else (),
        experts=experts if role == "serve" else (),
        remote_experts=remote_experts if role == "serve" else "off",
        experts_connect_timeout_s=connect_s,
        experts_message_timeout_s=message_s,
        experts_layer_timeout_s=layer_s,
        experts_poll_s=poll_s,
        stages=stages if role == "serve" else (),
        pipeline=pipeline if role == "serve" else "off",
        pipeline_memory_mb=pipeline_memory_mb,
        join_token=join_token,
        join_file=join_file,
        mesh_name=mesh_name,
        mdns=not no_mdns,
        api_key_file=api_key_file,
        log_format=log_format,
        log_level=log_level,
        config_file=config_path,
        notes=tuple(notes),
    )
