"""Prometheus metrics of the API node (one registry per server, so several servers fit in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PeersCollector(Collector):
    def __init__(self, states: Callable[[], dict[str, int]]) -> None:
        self.states = states

    def collect(self):  # type: ignore[no-untyped-def]
        g = GaugeMetricFamily("meshd_peers", "Peers of this node by state", labels=["state"])
        counts = {"alive": 0, "suspect": 0, "dead": 0, "left": 0}
        counts.update(self.states())
        for state, n in sorted(counts.items()):
            g.add_metric([state], n)
        yield g


class ApiMetrics:
    def __init__(self, peer_states: Callable[[], dict[str, int]] | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("meshd_api_requests", "API requests by endpoint, route and status code",
                                ["endpoint", "route", "code"], registry=r)
        self.tokens = Counter("meshd_api_tokens", "Tokens processed for requests generated on this node",
                              ["kind"], registry=r)
        self.latency = Histogram("meshd_api_request_seconds", "Time from request to the last byte",
                                 ["endpoint", "route"], registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttfb = Histogram("meshd_api_first_byte_seconds", "Time from request to the first response byte",
                              ["route"], registry=r,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60))
        self.in_flight = Gauge("meshd_api_in_flight", "Generation requests in progress on this API", registry=r)
        self.tunnel_bytes = Counter("meshd_tunnel_bytes", "Bytes through HTTP tunnel streams",
                                    ["direction"], registry=r)
        self.routes = Counter("meshd_route_decisions", "Where requests were sent (local, tunnel, none)",
                              ["decision"], registry=r)
        self.errors = Counter("meshd_api_errors", "API errors by status code and error code",
                              ["status", "code"], registry=r)
        self.retries = Counter("meshd_route_retries", "Requests retried on another node before the first byte",
                               registry=r)
        self.connections_closed = Counter(
            "meshd_api_connections_closed", "Connections the API closed itself, by reason (head_timeout, "
            "body_timeout, evicted, refused, bad_http, write_stalled)", ["reason"], registry=r)
        self._tunnel_in = self.tunnel_bytes.labels("in")
        self._tunnel_out = self.tunnel_bytes.labels("out")
        if peer_states is not None:
            r.register(_PeersCollector(peer_states))

    def count_tunnel(self, direction: str, n: int) -> None:
        (self._tunnel_in if direction == "in" else self._tunnel_out).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
