"""The daemon's expert service: worker side (``--experts``) and coordinator side (``--remote-experts``).

Worker side: at start every ``--experts`` spec is loaded and validated (a bad one fails the start with a
one-line reason naming it), its fingerprint computed (cached next to the checkpoint), and EXPERT streams
are served by :class:`engine.experts.worker.ExpertWorker`. ``advertisement()`` gives what membership
gossips about this node's shards (fingerprint, layer/expert ranges, capacity).

Coordinator side: the model service calls :meth:`ExpertsService.coordinator` for an MoE checkpoint it
serves; the returned :class:`RemoteExecutor` is the ``executor`` for ``Model.forward``. Workers are found
by probing peers: every connected peer (or, once membership advertises shards, every peer advertising
the fingerprint) is opened an EXPERT stream and sent a hello; those holding the same checkpoint become
links; a peer holding another checkpoint (or speaking no common version) is remembered as refused until it
reconnects, one that did not answer is retried after ``REFUSAL_RETRY_S``; one whose experts are still loading
(it answers ``LOADING``) is no refusal: shown as ``loading``, asked again within ``LOADING_RETRY_S`` and at
once when it advertises its shards. Probes repeat on peer-up and every
``probe_interval_s``, so a worker that joins is used from the next forward pass.

Telemetry: ``status()`` (merged into ``meshd status --json`` under ``experts``) and a Prometheus
collector (``meshd_experts_*``) registered while the service runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from engine.experts import direct
from engine.experts.coordinator import CoordinatorConfig, NotAWorker, RemoteExecutor, WorkerRefused
from engine.experts.fingerprint import model_fingerprint
from engine.experts.rpc import ErrorCode
from engine.experts.layout import LayoutError, MoeLayout, layout_from_config, read_config
from engine.experts.shard import ExpertShard, ShardError, load_shard
from engine.experts.tensors import TensorFileError
from engine.experts.worker import ExpertWorker, ReplyHook, answer_loading
from engine.moe import ExpertWeightsFn
from meshd.errors import UsageError
from engine import limits, numerics

log = structlog.get_logger(__name__)

PROBE_INTERVAL_S = 5.0  # how often peers that are not links yet are probed for experts
REFUSAL_RETRY_S = 30.0  # a peer that did not answer a hello (busy, no handler) is asked again after this
REFUSAL_RETRY_FIRST_S = 0.5  # ...first after this, doubling up to REFUSAL_RETRY_S: a worker that joined a
# moment ago may not have registered its expert handler yet when the coordinator's first hello arrives
LOADING_RETRY_S = 5.0  # a worker still loading its experts is asked again after 0.5 s, doubling up to this
# (and at once when gossip shows its shards, which it publishes as soon as they are loaded)


def refusal_retry_delay_s(failures: int, cap_s: float = REFUSAL_RETRY_S) -> float:
    """Seconds before asking a peer again after ``failures`` (>= 1) unanswered hellos in a row."""
    return min(cap_s, REFUSAL_RETRY_FIRST_S * 2.0 ** max(0, failures - 1))


class ExpertsStartError(UsageError):
    """An ``--experts`` spec cannot be served; the message names the spec and the problem (exit 2)."""


@dataclass
class _Coordinated:
    path: Path
    executor: RemoteExecutor
    refused: dict[str, str] = field(default_factory=dict)  # node id -> reason
    retry_at: dict[str, float] = field(default_factory=dict)  # node id -> loop time to probe again
    probing: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # node id -> hello in flight
    failures: dict[str, int] = field(default_factory=dict)  # node id -> unanswered hellos in a row
    loading_asks: dict[str, int] = field(default_factory=dict)  # node id -> hellos answered LOADING in a row
    plain: set[str] = field(default_factory=set)  # peers serving no expert stream (not workers): not listed
    dialling: set[str] = field(default_factory=set)  # node ids whose direct channel is being dialled


class ExpertsService:
    """See the module docstring. ``start(daemon)`` needs ``daemon.transport`` (a ``MeshTransport``)."""

    name = "experts"

    def __init__(self, specs: Sequence[str] = (), remote_experts: str = "off", *,
                 coordinator_config: CoordinatorConfig | None = None, capacity: float = 1.0,
                 probe_interval_s: float = PROBE_INTERVAL_S, reply_hook: ReplyHook | None = None) -> None:
        self.specs = list(specs)
        self.remote_experts = remote_experts
        self.coordinator_config = coordinator_config or CoordinatorConfig()  # timeouts, poll; mode per model
        self.capacity = capacity
        self.probe_interval_s = probe_interval_s
        self._reply_hook = reply_hook
        self.shards: list[ExpertShard] = []
        self.fingerprints: list[bytes] = []
        self.worker: ExpertWorker | None = None
        self.transport: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._coordinated: list[_Coordinated] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._retry_timers: set[asyncio.TimerHandle] = set()  # hellos to ask again (cancelled on stop)
        self._collector: Any = None
        self._state_dir: Path | None = None
        self._membership: Any = None
        self._kept: set[str] = set()  # workers we asked the transport to keep connected
        self.advertisers: list[Callable[[list[dict[str, Any]]], None]] = []  # membership hooks
        self._loading: str | None = None  # what a hello is answered (ERROR LOADING) until the shards are in

    @classmethod
    def from_config(cls, config: Any) -> ExpertsService:
        """From the daemon's ``DaemonConfig`` (``experts``, ``remote_experts``, ``experts_*_timeout_s``,
        ``experts_poll_s``)."""
        settings = CoordinatorConfig(connect_timeout_s=config.experts_connect_timeout_s,
                                     message_timeout_s=config.experts_message_timeout_s,
                                     layer_timeout_s=config.experts_layer_timeout_s,
                                     poll_s=config.experts_poll_s)
        return cls(tuple(config.experts), config.remote_experts, coordinator_config=settings)

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self, daemon: Any) -> None:
        self.transport = getattr(daemon, "transport", daemon)
        self._loop = asyncio.get_running_loop()
        from transport.streams import StreamType

        state = getattr(daemon, "state", None)
        self._state_dir = getattr(state, "path", None)
        if self.specs:
            # the daemon is in its mesh already: a coordinator's hello now is told "loading", not left
            # unanswered (which counted as an error and backed off for up to REFUSAL_RETRY_S)
            self._loading = f"experts of {', '.join(self.specs)} are not loaded yet"
            self.transport.on_stream(StreamType.EXPERT, self._serve)
            self.shards, self.fingerprints = await asyncio.to_thread(self._load_all)
            await asyncio.to_thread(numerics.tag)  # computed once, off the loop (it may import the kernels)
            self.worker = ExpertWorker(self.shards, self.fingerprints, self.capacity, self._reply_hook,
                                       poll_s=self.coordinator_config.poll_s)  # one setting for both roles
            self._loading = None
            for s, fp in zip(self.shards, self.fingerprints):
                log.info("experts_worker_ready", path=str(s.path), fingerprint=fp.hex()[:16], layers=len(s.layers),
                         experts=len(s.experts), expert_bytes=s.expert_bytes)
            adv = self.advertisement()
            for cb in self.advertisers:
                cb(adv)
        self._membership = _find_membership(daemon)
        if self._membership is not None:
            if self.shards:
                self._publish_shards()
            self._membership.on_change(self._membership_changed)
        self.transport.on_peer_up.append(self._peer_up)
        self.transport.on_peer_down.append(self._peer_down)
        lanes = getattr(self.transport, "lane", None)  # transport.lane.LaneManager (the lane service)
        if lanes is not None:
            lanes.on_path_change.append(self._path_changed)
            if self.worker is not None:
                from transport.lane_direct import SERVICE_EXPERTS

                worker = self.worker
                lanes.direct_handlers[SERVICE_EXPERTS] = \
                    lambda peer, ch: direct.serve(worker, peer.node_id, ch)
        self._spawn(self._probe_loop())

    def _load_all(self) -> tuple[list[ExpertShard], list[bytes]]:
        shards, fps = [], []
        for spec in self.specs:
            resolved = self._resolve(spec)
            try:
                shard = load_shard(resolved)
                fp = model_fingerprint(shard.path, cache_dir=self._state_dir)
            except ShardError as e:
                text = str(e)
                if resolved != spec:  # `tiny`: name the spec as given, not the state dir's checkpoint
                    for given in (resolved, resolved.rpartition("@")[0] or resolved):
                        if text.startswith(f"--experts {given}:"):
                            text = f"--experts {spec}:" + text[len(f"--experts {given}:"):]
                            break
                raise ExpertsStartError(text) from None
            except (TensorFileError, LayoutError, OSError) as e:
                raise ExpertsStartError(f"--experts {spec}: {e}") from None
            shard.warm()
            shards.append(shard)
            fps.append(fp)
        return shards, fps

    def _resolve(self, spec: str) -> str:
        """``tiny[@LAYERS/EXPERTS]`` -> the state dir's tiny checkpoint (the same one ``--model tiny`` uses)."""
        path, at, suffix = spec.partition("@")
        if path != "tiny":
            return spec
        if self._state_dir is None:
            raise ExpertsStartError("--experts tiny needs a state directory")
        from engine.tiny import ensure_tiny

        return str(ensure_tiny(self._state_dir)) + at + suffix

    async def stop(self) -> None:
        if self.worker is not None:
            self.worker.close()
        for handle in self._retry_timers:
            handle.cancel()
        self._retry_timers.clear()
        probes = [t for c in self._coordinated for t in c.probing.values()]
        for task in list(self._tasks) + probes:
            task.cancel()
        await asyncio.gather(*self._tasks, *probes, return_exceptions=True)
        for c in self._coordinated:
            await c.executor.close()
        if self.transport is not None:
            for node in self._kept:
                with contextlib.suppress(Exception):
                    self.transport.forget(node)
            with contextlib.suppress(ValueError):
                self.transport.on_peer_up.remove(self._peer_up)
            with contextlib.suppress(ValueError):
                self.transport.on_peer_down.remove(self._peer_down)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- worker side ------------------------------------------------------------------------------

    async def _serve(self, peer: Any, stream: Any) -> None:
        if self.worker is not None:
            await self.worker.serve(stream, peer.node_id)
        elif self._loading is not None:
            await answer_loading(stream, self._loading)

    def advertisement(self) -> list[dict[str, Any]]:
        """What gossip carries about this node's shards, in the membership record's format: one entry
        per held rectangle ``{"model_fp", "layers": [first, last], "experts": [first, last], "capacity"}``."""
        cap = max(1, round(self.capacity))
        return [{"model_fp": fp.hex(), "layers": [r.layer_first, r.layer_last],
                 "experts": [r.expert_first, r.expert_last], "capacity": cap}
                for s, fp in zip(self.shards, self.fingerprints) for r in s.ranges]

    def _publish_shards(self) -> None:
        """Put our shards into this node's membership record (gossiped to the mesh)."""
        try:
            from meshd.membership.records import ExpertShard as RecordShard
        except ImportError:  # membership not built in
            return
        adv = self.advertisement()
        if len(adv) > limits.EXPERT_MAX_ADVERTISED_RANGES:
            log.warning("experts_advertisement_truncated", ranges=len(adv), kept=limits.EXPERT_MAX_ADVERTISED_RANGES)
            adv = adv[: limits.EXPERT_MAX_ADVERTISED_RANGES]
        self._membership.set_local_experts([
            RecordShard(a["model_fp"], (a["layers"][0], a["layers"][1]), (a["experts"][0], a["experts"][1]),
                        a["capacity"]) for a in adv])
        self._membership.set_local_field("numerics", numerics.tag())  # beside the shards (engine/numerics.py)

    # --- coordinator side -------------------------------------------------------------------------

    def advertised_workers(self, fingerprint: bytes) -> dict[str, list[str]]:
        """From gossip: alive nodes advertising shards of ``fingerprint`` -> their addresses."""
        if self._membership is None:
            return {}
        want, out = fingerprint.hex(), {}
        for view in self._membership.alive_peers():
            rec = view.record
            if any(getattr(e, "model_fingerprint", None) == want for e in getattr(rec, "experts", ())):
                out[view.node_id] = list(getattr(rec, "addrs", ()))
        return out

    def _membership_changed(self, _event: Any) -> None:
        if self._coordinated and self._loop is not None:
            self._spawn(self._connect_advertised())

    async def _connect_advertised(self) -> None:
        """Keep a connection to every advertised worker of our models (peer-up then probes it); one that
        said it was loading is asked again now (it advertises its shards once they are loaded)."""
        for c in self._coordinated:
            for node, addrs in self.advertised_workers(c.executor.fingerprint).items():
                if node in c.executor.loading or node in c.plain:
                    c.retry_at.pop(node, None)
                me = getattr(getattr(self.transport, "identity", None), "node_id", None)
                if node in self._kept or node == me:
                    continue
                parsed = [a for a in (_parse_addr(x) for x in addrs) if a is not None]
                if parsed and hasattr(self.transport, "keep_connected"):
                    self._kept.add(node)
                    self.transport.keep_connected(node, parsed)
        await self.probe_all()

    async def coordinator(self, path: str | Path, local_weights: ExpertWeightsFn | None = None,
                          mode: str | None = None) -> RemoteExecutor:
        """The remote executor for the MoE checkpoint at ``path`` (call on the daemon loop).

        ``local_weights`` is needed for ``prefer`` (fallback). Raises ``LayoutError``/``TensorFileError``
        for a checkpoint without routed experts.
        """
        p = Path(path)
        layout: MoeLayout = layout_from_config(read_config(p))
        fp = await asyncio.to_thread(lambda: model_fingerprint(p, cache_dir=self._state_dir))
        await asyncio.to_thread(numerics.tag)  # the workers' hello acks are checked against it
        mode = mode or (self.remote_experts if self.remote_experts in ("on", "prefer") else "on")
        cfg = dataclasses.replace(self.coordinator_config, mode=mode)
        ex = RemoteExecutor(asyncio.get_running_loop(), fp, layout, cfg, local_weights)
        c = _Coordinated(p, ex)
        self._coordinated.append(c)
        log.info("experts_coordinator_ready", path=str(p), fingerprint=fp.hex()[:16], mode=mode)
        await self._connect_advertised()
        return ex

    async def executor_for(self, path: str | Path, local_weights: ExpertWeightsFn | None) -> RemoteExecutor | None:
        """For the engine adapter: the executor to pass to ``Scheduler(..., executor=)`` / ``forward``, or
        None when ``--remote-experts off`` or the checkpoint has no routed experts (then run locally)."""
        if self.remote_experts not in ("on", "prefer"):
            return None
        try:
            layout_from_config(read_config(Path(path)))
        except LayoutError:
            return None
        return await self.coordinator(path, local_weights)

    def _peers(self) -> Iterable[Any]:
        return [p for p in self.transport.peers() if getattr(p, "connected", True)] if self.transport else []

    async def probe_all(self) -> None:
        """Hello every connected peer that is not yet a link or a refusal; returns when all hellos in
        flight (including ones started elsewhere) are done."""
        waits: list[asyncio.Task[None]] = []
        for c in self._coordinated:
            for peer in self._peers():
                node = peer.node_id
                if node in c.executor.links:
                    link = c.executor.links[node]
                    if (link.direct is None or link.direct.closed) and node not in c.dialling:
                        waits.append(asyncio.get_running_loop().create_task(self._attach_direct(c, peer)))
                    continue
                if node in c.refused:
                    at = c.retry_at.get(node)
                    if at is None or asyncio.get_running_loop().time() < at:
                        continue
                    del c.refused[node], c.retry_at[node]
                elif node in c.executor.loading or node in c.plain:
                    at = c.retry_at.get(node)
                    if at is not None and asyncio.get_running_loop().time() < at:
                        continue
                task = c.probing.get(node)
                if task is None:
                    task = asyncio.get_running_loop().create_task(self._probe(c, peer))
                    c.probing[node] = task
                    task.add_done_callback(lambda _t, c=c, node=node: c.probing.pop(node, None))
                waits.append(task)
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    async def _probe(self, c: _Coordinated, peer: Any) -> None:
        from transport.streams import StreamType

        node = peer.node_id
        try:
            timeout = c.executor.config.connect_timeout_s
            stream = await asyncio.wait_for(peer.open_stream(StreamType.EXPERT), timeout)
            await c.executor.add_worker(node, stream)
            c.failures.pop(node, None)
            c.loading_asks.pop(node, None)
            c.plain.discard(node)
            await self._attach_direct(c, peer)
        except NotAWorker:  # a plain member: asked again after REFUSAL_RETRY_S, or when it advertises shards
            c.loading_asks.pop(node, None)
            c.plain.add(node)
            self._retry_later(c, node, REFUSAL_RETRY_S)
            log.debug("experts_peer_not_a_worker", peer=node)
        except WorkerRefused as e:
            c.plain.discard(node)
            if e.code == ErrorCode.LOADING:  # up, experts not in yet: not a refusal, ask again soon
                c.loading_asks[node] = n = c.loading_asks.get(node, 0) + 1
                self._retry_later(c, node, refusal_retry_delay_s(n, LOADING_RETRY_S))
                log.info("experts_worker_loading", worker=node, reason=str(e))
                return
            c.loading_asks.pop(node, None)
            c.refused[node] = str(e)
            if e.code not in (ErrorCode.FINGERPRINT_MISMATCH, ErrorCode.VERSION_UNSUPPORTED,
                              ErrorCode.NUMERICS_MISMATCH):
                c.failures[node] = n = c.failures.get(node, 0) + 1
                self._retry_later(c, node, refusal_retry_delay_s(n))
            log.info("experts_worker_refused", worker=node, reason=str(e))
        except Exception as e:  # noqa: BLE001 - a peer that cannot be probed now is retried later
            log.debug("experts_probe_failed", worker=node, error=repr(e))

    def _retry_later(self, c: _Coordinated, node: str, delay: float) -> None:
        """Probe ``node`` again after ``delay`` seconds (``probe_all`` skips it until then)."""
        loop = asyncio.get_running_loop()
        c.retry_at[node] = loop.time() + delay

        def retry() -> None:
            self._retry_timers.discard(handle)
            self._spawn(self.probe_all())

        handle = loop.call_later(delay + 0.01, retry)
        self._retry_timers.add(handle)

    async def _attach_direct(self, c: _Coordinated, peer: Any) -> None:
        """Dial a direct channel (``engine.experts.direct``) beside a worker's link that rides a data lane
        (TCP reaches the worker), and hello it there. Best effort: without one, the stream serves."""
        from transport.errors import TransportError
        from transport.lane_direct import SERVICE_EXPERTS
        from transport.stream_api import PATH_LANE

        node = peer.node_id
        ex = c.executor
        link = ex.links.get(node)
        lanes = getattr(self.transport, "lane", None)
        if (not direct.enabled() or not ex.config.direct or lanes is None or link is None or link.closed
                or link.ack is None                or (link.direct is not None and not link.direct.closed) or node in c.dialling
                or getattr(link.channel, "path", None) != PATH_LANE):
            return
        c.dialling.add(node)
        try:
            ch = await lanes.dial_direct(peer, SERVICE_EXPERTS)
            d = direct.DirectLink(ch)
            try:
                await asyncio.to_thread(d.hello, ex.fingerprint, ex.layout, link.ack.version,
                                        ex.config.connect_timeout_s)
            except direct.DirectFailed:
                d.close("hello failed")
                raise
            if ex.links.get(node) is not link or link.closed:
                d.close("the link was replaced")
                return
            link.direct = d
            log.info("experts_direct_up", worker=node)
        except (TransportError, direct.DirectFailed, OSError) as e:
            log.info("experts_direct_unavailable", worker=node, error=str(e))
        finally:
            c.dialling.discard(node)

    def _peer_up(self, peer: Any) -> None:
        for c in self._coordinated:
            c.refused.pop(peer.node_id, None)
            c.retry_at.pop(peer.node_id, None)
        if self._coordinated:
            self._spawn(self.probe_all())

    def _path_changed(self, peer: Any) -> None:
        """A data lane to ``peer`` came up or went down: greet its worker again over the path in use now
        (the new link replaces the old one; the old one finishes the replies in flight first)."""
        for c in self._coordinated:
            link = c.executor.links.get(peer.node_id)
            if link is None and peer.node_id not in c.refused and peer.node_id not in c.plain:
                self._spawn(self._probe(c, peer))  # a link the lane's end broke: back over QUIC now
            elif link is not None and getattr(link.channel, "path", None) != peer.path:
                self._spawn(self._probe(c, peer))

    def _peer_down(self, peer: Any) -> None:
        for c in self._coordinated:
            c.executor.remove_worker(peer.node_id, "peer disconnected")
            c.refused.pop(peer.node_id, None)
            c.retry_at.pop(peer.node_id, None)
            c.failures.pop(peer.node_id, None)
            c.loading_asks.pop(peer.node_id, None)
            c.plain.discard(peer.node_id)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.probe_all()
            except Exception as e:  # noqa: BLE001 - keep probing
                log.debug("experts_probe_loop_error", error=repr(e))

    # --- telemetry --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"remote_experts": self.remote_experts}
        if self.remote_experts in ("on", "prefer") or self._coordinated:
            cfg = self.coordinator_config  # what coordinator() gives each executor
            out["timeouts"] = {"connect_s": cfg.connect_timeout_s, "message_s": cfg.message_timeout_s,
                               "layer_s": cfg.layer_timeout_s}
        if self.worker is not None or "timeouts" in out:
            out["poll_s"] = self.coordinator_config.poll_s  # --experts-poll
            out["numerics"] = numerics.tag()  # engine/numerics.py: a worker with another is refused
        if self.worker is not None:
            out["worker"] = {**self.worker.stats.as_dict(), "capacity": self.capacity,
                             "shards": [{"path": str(s.path), "fingerprint": fp.hex(), "layers": list(s.layers),
                                         "experts": list(s.experts),
                                         "expert_bytes": s.expert_bytes}
                                        for s, fp in zip(self.shards, self.fingerprints)]}
        if self._coordinated:
            out["coordinators"] = [{"path": str(c.path), **c.executor.status(), "refused": dict(c.refused)}
                                   for c in self._coordinated]
        return out

    def metrics(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        """(name, type, help, labels, value) samples for /metrics."""
        m: list[tuple[str, str, str, dict[str, str], float]] = []
        if self.worker is not None:
            st = self.worker.stats
            for key, what in (("requests", "expert requests served"), ("rows", "hidden rows received"),
                              ("pairs", "(row, expert) outputs computed"),
                              ("rows_combined", "rows combined here and sent as one row"),
                              ("bytes_in", "bytes received"),
                              ("bytes_out", "bytes sent"), ("errors", "requests answered with an error"),
                              ("polls", "answers after which the worker polled for the next request")):
                m.append((f"meshd_experts_worker_{key}_total", "counter", f"Worker: {what}", {},
                          float(getattr(st, key))))
            m.append(("meshd_experts_worker_compute_seconds_total", "counter", "Worker: expert compute time", {},
                      st.compute_s))
        for c in self._coordinated:
            model = c.path.name
            for node, ls in c.executor.link_stats.items():
                lab = {"model": model, "worker": node}
                for key, what in (("calls", "expert requests answered"), ("rows", "hidden rows sent"),
                                  ("pairs", "(row, expert) pairs delegated"), ("bytes_out", "bytes sent"),
                                  ("bytes_in", "bytes received"), ("errors", "failed requests")):
                    m.append((f"meshd_experts_worker_link_{key}_total", "counter", f"Coordinator: {what}", lab,
                              float(getattr(ls, key))))
            s = c.executor.stats
            lab = {"model": model}
            for key, what in (("layers", "sparse layer calls"), ("layers_delegated", "layers sent to workers"),
                              ("items_delegated", "expert work items computed by workers"),
                              ("items_local", "expert work items computed locally (prefer fallback)"),
                              ("local_fallback_layers", "layers that fell back to local compute"),
                              ("retries", "work items retried on another holder"),
                              ("rows_combined", "token rows combined by a worker"),
                              ("unavailable", "layers failed for lack of workers"),
                              ("passes_on_loop", "forward passes run on the event loop (decode steps)"),
                              ("passes_handed_back", "loop-run passes handed back to the engine thread")):
                m.append((f"meshd_experts_{key}_total", "counter", f"Coordinator: {what}", lab,
                          float(getattr(s, key))))
            m.append(("meshd_experts_hit_rows_total", "counter", "Routed (row, expert) hits, delegated and local",
                      lab, float(sum(s.expert_rows.values()))))
        return m

    def collector(self) -> Any:
        """A prometheus_client collector of :meth:`metrics` plus the per-worker latency histogram."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        from engine.experts.coordinator import LATENCY_BUCKETS_S

        service = self

        class _Collector:
            def collect(self) -> Iterable[Any]:
                families: dict[str, Any] = {}
                for name, _kind, help_text, labels, value in service.metrics():
                    base = name[: -len("_total")] if name.endswith("_total") else name
                    fam = families.get(base)
                    if fam is None:
                        fam = families[base] = CounterMetricFamily(base, help_text, labels=sorted(labels))
                    fam.add_metric([labels[k] for k in sorted(labels)], value)
                hist = HistogramMetricFamily("meshd_experts_worker_link_latency_seconds",
                                             "Coordinator: request-to-reply time per worker",
                                             labels=["model", "worker"])
                for c in service._coordinated:
                    for node, ls in c.executor.link_stats.items():
                        cum, buckets = 0, []
                        for bound, n in zip(LATENCY_BUCKETS_S, ls.latency_buckets):
                            cum += n
                            buckets.append((repr(bound), cum))
                        buckets.append(("+Inf", cum + ls.latency_buckets[-1]))
                        hist.add_metric([c.path.name, node], buckets, ls.latency_sum_s)
                return [*families.values(), hist]

        return _Collector()

    def prometheus_collectors(self) -> list[Any]:
        """Collectors the API's /metrics registry should include (same hook style as ``api_backends``)."""
        if self._collector is None:
            self._collector = self.collector()
        return [self._collector]


def _find_membership(daemon: Any) -> Any:
    """The daemon's membership service (duck-typed: ``set_local_experts``, ``alive_peers``, ``on_change``)."""
    for svc in getattr(daemon, "services", []) or []:
        if all(hasattr(svc, a) for a in ("set_local_experts", "alive_peers", "on_change")):
            return svc
    return None


def _parse_addr(text: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` -> (host, port); None if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host, int(port)) if host and 0 < int(port) < 65536 else None


def experts_of(daemon: Any) -> ExpertsService | None:
    """The daemon's expert service, if it runs one (``--experts`` or ``--remote-experts``)."""
    for svc in getattr(daemon, "services", []) or []:
        if isinstance(svc, ExpertsService):
            return svc
    return None
