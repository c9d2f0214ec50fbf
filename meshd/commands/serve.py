"""`meshd serve` and `meshd client`: load config, identity and credentials, then run the daemon."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import time
from pathlib import Path
from types import FrameType

import structlog

from meshd import numba_cache
from meshd.api.server import bind_api, load_api_keys
from meshd.config import DaemonConfig, load_config
from meshd.daemon import Daemon
from meshd.errors import RuntimeFailure, UsageError
from meshd.log import setup_logging
from meshd.state import StateDir
from meshd.wiring import build_services
from transport import PROTOCOL_MAX, PROTOCOL_MIN
from transport.credentials import create_mesh

log = structlog.get_logger("meshd.serve")


def _stop_during_startup(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # the CLI turns it into exit 0; Daemon.run installs the real handlers


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint directory or a .gguf file (the engine loads both; a split set by its first file)."""
    from engine.gguf_file import is_gguf

    return path.is_dir() or (is_gguf(path) and path.is_file())


def _check_specs(config: DaemonConfig) -> None:
    """Refuse model, expert and stage SPECs that cannot work (syntax, a checkpoint directory that does
    not exist, layers or experts its config does not have) with one line, before the node creates or
    touches anything (no key, no mesh, no redeemed token). Loading errors come later."""
    from engine.spec import parse_model_spec

    models = config.models if config.role == "serve" else []
    names: dict[str, str] = {}  # served name -> the --model that took it
    for text in models:
        try:
            spec = parse_model_spec(text)
        except ValueError as e:
            raise UsageError(f"--model {text}: {e}") from None
        if spec.kind == "path" and spec.path is not None and not _is_checkpoint(spec.path):
            raise UsageError(f"--model {text}: {spec.path} is not a checkpoint directory or .gguf file")
        if spec.kind in ("tiny", "path"):  # an openai: server's names are known once it answers
            if spec.name in names:
                raise UsageError(f"--model {text}: the name '{spec.name}' is taken by --model {names[spec.name]} "
                                 f"(give one of them another with NAME=)")
            names[spec.name] = text
    experts = config.experts if config.role == "serve" else []
    for text in experts:
        from engine.experts.shard import ShardError, parse_spec

        try:
            shard = parse_spec(text)
        except ShardError as e:
            msg = str(e)
            raise UsageError(msg if msg.startswith("--experts") else f"--experts {text}: {msg}") from None
        path = getattr(shard, "path", None)
        if path is not None and str(path) != "tiny" and not _is_checkpoint(Path(path)):
            raise UsageError(f"--experts {text}: {path} is not a checkpoint directory or .gguf file")
        if path is not None and str(path) != "tiny":
            from engine.experts.shard import check_ranges

            try:  # layers and experts that the checkpoint has (its config only)
                check_ranges(shard)
            except ShardError as e:
                raise UsageError(str(e)) from None
    offered: dict[str, str] = {}  # checkpoint -> the --stage that offers it
    for text in config.stages if config.role == "serve" else []:
        from meshd.pipeline_service import parse_stage_spec

        stage_path, pin = parse_stage_spec(text)
        if stage_path != "tiny" and not _is_checkpoint(Path(stage_path)):
            raise UsageError(f"--stage {text}: {stage_path} is not a checkpoint directory or .gguf file")
        key = "tiny" if stage_path == "tiny" else str(Path(stage_path).resolve())
        if key in offered:  # a run's steps reach a stage node by run id: one range of a checkpoint per node
            raise UsageError(f"--stage {text}: --stage {offered[key]} offers this checkpoint already; a node "
                             f"holds one range of it (give one --stage with the whole range, or none for any)")
        offered[key] = text
        layers = _num_layers(Path(stage_path)) if pin is not None and stage_path != "tiny" else None
        if pin is not None and layers is not None and pin[1] >= layers:
            raise UsageError(f"--stage {text}: the model has layers 0-{layers - 1}")


def _num_layers(path: Path) -> int | None:
    """The checkpoint's layer count from its config (or GGUF metadata) alone; None when that cannot be
    read here (the stage's load names the problem)."""
    from engine.config import ModelConfig
    from engine.experts.layout import read_config

    try:
        return int(ModelConfig.from_hf(read_config(path)).num_layers)
    except Exception:  # noqa: BLE001 - any config problem is reported by the load, with its own words
        return None


def _probe_udp(config: DaemonConfig) -> None:
    """Fail (exit 1) now if the QUIC address is taken, before anything is created. The transport binds
    it again moments later; a port taken in between still fails there, with the same message."""
    host, port = config.listen.host, config.listen.port
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
        with socket.socket(infos[0][0], socket.SOCK_DGRAM) as s:
            s.bind(infos[0][4])
    except OSError as e:
        raise RuntimeFailure(f"cannot listen on {config.listen} (UDP): {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _stop_during_startup)
    config = load_config(args, os.environ, role=args.command)
    setup_logging(config.log_format, config.log_level)
    for note in config.notes:
        log.info("config_note", note=note)
    if getattr(args, "join", None) not in (None, "-"):
        log.warning("join_token_on_command_line", hint="any local user can read it in ps while meshd runs; "
                    "use --join - (standard input), --join-file FILE (mode 0600) or MESHD_JOIN_FILE")
    _check_specs(config)  # a mistyped --model/--experts is exit 2 before any state is written
    if config.api_key_file is not None:
        load_api_keys(config.api_key_file)  # an unsafe or empty key file: exit 2 before anything is written
    state = StateDir(config.state_dir)
    state.check()  # an unsafe state dir or files: exit 1 before anything is written
    existed = state.path.is_dir()
    if existed:
        state.lock()  # "another meshd is running" is the better message than its ports being taken
    # Bind first: a taken port must not leave a new key, a founded mesh or a loaded model behind.
    _probe_udp(config)
    api_sockets = bind_api(config.api.host, config.api.port)
    if not existed:
        state.lock()  # held for the life of the process: one daemon per state dir
    if config.has_join and not state.has_credentials():
        # Fail now (exit 2) on a missing/empty join file rather than found a stray mesh; the
        # membership service re-reads it on every attempt.
        config.read_join_token()
    cache = numba_cache.apply(state.path)  # before any engine module imports numba
    if cache is not None:
        log.info("numba_cache_dir", path=str(cache), reason="the install and the home directory are read-only")
    identity, created = state.load_or_create_identity()
    if created:
        log.info("identity_created", node_id=identity.node_id, path=str(state.identity_path))
    creds = state.load_credentials(identity)
    if creds is None:
        if config.has_join:
            log.info("waiting_to_join", node_id=identity.node_id)
        else:
            creds = create_mesh(identity, config.mesh_name, int(time.time()), PROTOCOL_MIN, PROTOCOL_MAX)
            state.store_credentials(creds)
            log.info(
                "mesh_created",
                mesh_id=creds.mesh_id,
                mesh_name=creds.genesis.name,
                node_id=identity.node_id,
                state_dir=str(state.path),
            )
    daemon = Daemon(config, state, identity, creds, services=build_services(config))
    daemon.api_sockets = api_sockets  # type: ignore[attr-defined]  # the API service listens on these
    return asyncio.run(daemon.run())
