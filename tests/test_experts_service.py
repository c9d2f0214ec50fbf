"""ExpertsService telemetry pieces: advertisement format and Prometheus exposition."""

from __future__ import annotations

from pathlib import Path

from experts_util import make_moe_checkpoint
from prometheus_client import CollectorRegistry, generate_latest

from engine.experts.channel import LoopThread
from meshd.experts_service import ExpertsService


class _FakeTransport:
    """Only the registration surface the service touches (no network in this unit test)."""

    def __init__(self) -> None:
        self.on_peer_up: list[object] = []
        self.on_peer_down: list[object] = []
        self.handlers: dict[int, object] = {}

    def on_stream(self, stream_type: int, handler: object) -> None:
        self.handlers[int(stream_type)] = handler

    def peers(self) -> list[object]:
        return []


def test_advertisement_and_metrics(tmp_path: Path) -> None:
    ck = make_moe_checkpoint(tmp_path / "m", layers=3, experts=8)
    svc = ExpertsService([f"{ck}@0-1/0-3", f"{ck}@2/4-7"], "prefer", capacity=2.0)
    lt = LoopThread()
    try:
        t = _FakeTransport()
        lt.run(svc.start(t))
        assert 4 in t.handlers  # StreamType.EXPERT
        adv = svc.advertisement()
        fp = svc.fingerprints[0].hex()
        assert adv == [{"model_fp": fp, "layers": [0, 1], "experts": [0, 3], "capacity": 2},
                       {"model_fp": fp, "layers": [2, 2], "experts": [4, 7], "capacity": 2}]
        ex = lt.run(svc.coordinator(ck, None, "on"))
        assert ex.unavailable_reason() == "no expert workers hold this model's routed experts"
        reg = CollectorRegistry()
        for c in svc.prometheus_collectors():
            reg.register(c)
        text = generate_latest(reg).decode()
        assert "meshd_experts_worker_requests_total 0.0" in text
        assert 'meshd_experts_layers_total{model="m"} 0.0' in text
        assert 'meshd_experts_passes_on_loop_total{model="m"} 0.0' in text
        assert "meshd_experts_worker_link_latency_seconds" in text
        st = svc.status()
        assert st["remote_experts"] == "prefer" and len(st["worker"]["shards"]) == 2
        assert st["coordinators"][0]["covered"] is False
    finally:
        lt.run(svc.stop())
        lt.stop()
