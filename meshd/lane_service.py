"""The daemon's data-path service: runs ``transport.lane.LaneManager`` (data lanes) and
``transport.relay.RelayManager`` (relay through a member; ``--relay off``: this node relays for nobody,
but still uses relays itself) on the daemon's transport.

``--lane-listen HOST:PORT`` binds there (a failure stops the start, like ``--listen``); by default the lane
takes TCP on the QUIC listen address and port, and if that TCP port is taken, an ephemeral one (peers ask
for the port over QUIC, so any port works). ``--lane-listen off``: no lanes to or from this node, and it
tells peers so when they ask. Status: ``lane`` (the bound address or null) and the lane statistics;
``/metrics``: ``meshd_lane_*`` counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import structlog

from meshd.config import DaemonConfig, format_hostport
from meshd.errors import RuntimeFailure
from transport.errors import TransportError

log = structlog.get_logger(__name__)


class LaneService:
    name = "lane"

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.manager: Any = None
        self.relay: Any = None

    async def start(self, daemon: Any) -> None:
        from transport.lane import LaneManager
        from transport.relay import RelayConfig, RelayManager

        transport = daemon.transport
        self.manager = LaneManager(transport)
        self.relay = RelayManager(transport, RelayConfig(allow_relay=self.config.relay))
        cfg = self.config
        if cfg.lane_off or cfg.lane_listen is None:
            log.info("lane_off")
            return
        host, port = cfg.lane_listen.host, cfg.lane_listen.port
        default = cfg.lane_listen == cfg.listen
        if default and daemon.quic_address is not None:
            port = daemon.quic_address.port  # the port QUIC actually bound (--listen may say 0)
        try:
            addr = await self.manager.listen(host, port)
        except TransportError as e:
            if not default:
                raise RuntimeFailure(f"cannot listen on --lane-listen {cfg.lane_listen}: {e}") from e
            log.warning("lane_port_taken", port=port, error=str(e))
            addr = await self.manager.listen(host, 0)
        daemon.lane_address = format_hostport(*addr)
        log.info("lane_listening", address=daemon.lane_address)

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.close()
        if self.manager is not None:
            await self.manager.close()

    def status(self) -> dict[str, Any]:
        out = self.manager.status() if self.manager is not None else {}
        if self.relay is not None:
            out["relay"] = self.relay.status()
        return out

    def prometheus_collectors(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        service = self

        class _Collector:
            def collect(self) -> Iterable[Any]:
                m = service.manager
                if m is None:
                    return []
                counter = CounterMetricFamily("meshd_lane_events", "Data lane events by kind", labels=["event"])
                for key, value in sorted(m.stats.items()):
                    counter.add_metric([key], float(value))
                gauge = GaugeMetricFamily("meshd_lane_open", "Data lanes open now")
                gauge.add_metric([], float(m.lane_count()))
                out = [counter, gauge]
                r = service.relay
                if r is not None:
                    relay = CounterMetricFamily("meshd_relay_events", "Relay through a member: events by kind "
                                                "(relay_bytes: bytes forwarded for others)", labels=["event"])
                    for key, value in sorted(r.stats.items()):
                        relay.add_metric([key], float(value))
                    out.append(relay)
                return out

        return [_Collector()]
