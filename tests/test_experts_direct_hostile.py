"""A member misbehaving on an expert worker's direct channel, against a real worker process (real QUIC,
lane and direct channel on loopback).

- a request whose reply cannot fit one direct-channel message (``LANE_DIRECT_MAX_RECORD_BYTES``) gets a
  typed TOO_LARGE error before anything is computed, and the channel stays in step (before: the worker
  computed every pair, then could not send the reply and closed the channel);
- garbage and a length prefix over the limit close only that channel; the worker keeps serving, the
  channel is dialled again and decode stays byte-identical to local.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest
from experts_mesh import Coordinator, MeshFixture, WorkerProc, spawn_worker
from experts_util import make_moe_checkpoint
from test_experts_direct import _wait_direct
from test_experts_lane import _decode

from engine.experts import rpc
from engine.experts.coordinator import CoordinatorConfig
from engine.model import Model
from transport import limits as tlimits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp("direct-hostile") / "q3", layers=3, experts=8, seed=11)



def test_hostile_messages_on_the_direct_channel(tmp_path: Path, ckpt: Path, procs: list[WorkerProc]) -> None:
    mesh = MeshFixture()
    procs.append(spawn_worker(mesh, tmp_path, [str(ckpt)]))
    w = procs[0]
    coord = Coordinator(mesh, CoordinatorConfig(message_timeout_s=5.0, layer_timeout_s=10.0), lane=True)
    try:
        coord.connect(procs)
        model = Model.load(ckpt)
        hidden, experts = model.config.hidden_size, model.config.num_experts
        ex = coord.executor(ckpt, "on")
        coord.wait_paths(procs, "lane")
        _wait_direct(coord, ex, w.node_id)
        ch = ex.links[w.node_id].direct.channel

        # 1. a reply too big for one direct message: a typed error, nothing computed, the channel in step
        rows = tlimits.LANE_DIRECT_MAX_RECORD_BYTES // (4 * hidden * experts) + 1
        x = np.ones((rows, hidden), dtype=np.float32)
        pairs = np.array([(r, e) for e in range(experts) for r in range(rows)], dtype=np.uint32)
        req = rpc.encode(rpc.ExpertRequest(0, x, pairs), 77)
        assert len(req) < tlimits.LANE_DIRECT_MAX_RECORD_BYTES
        assert 4 * len(pairs) * hidden > tlimits.LANE_DIRECT_MAX_RECORD_BYTES
        with ch.lock:
            ch.send(req, 10.0)
            t0 = time.monotonic()
            back = ch.recv(30.0)
            took = time.monotonic() - t0
            assert back is not None, ch.close_reason
            env = rpc.decode(back)
            assert env.request_id == 77 and isinstance(env.message, rpc.ErrorMsg), env
            assert env.message.code == rpc.ErrorCode.TOO_LARGE and "bytes" in env.message.text
            ch.send(rpc.encode(rpc.Echo(b"still here"), 78), 5.0)  # in step: the next exchange works
            echo = rpc.decode(ch.recv(5.0) or b"")
            assert echo.request_id == 78 and echo.message == rpc.EchoReply(b"still here")
        assert took < 5.0, took

        # 2. garbage closes the channel (the worker's end), then it is dialled again; decode is unharmed
        ref = _decode(model, None, 6)
        for hostile in (b"\x00garbage", struct.pack(">I", 0xFFFFFFF0)):
            ch = ex.links[w.node_id].direct.channel
            with ch.lock:
                ch._sock.sendall(hostile if hostile.startswith(b"\xff") else struct.pack(">I", len(hostile))
                                 + hostile)
                with pytest.raises(Exception):  # noqa: B017 - closed by the worker (None or an error)
                    if ch.recv(5.0) is None:
                        raise EOFError
            _wait_direct(coord, ex, w.node_id, up=False)
            _wait_direct(coord, ex, w.node_id)
            assert _decode(model, ex, 6) == ref
        assert ex.status()["items_local"] == 0
    finally:
        coord.close()
