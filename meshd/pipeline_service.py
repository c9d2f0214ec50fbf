"""The daemon's pipeline service: stage side (``--stage``) and serving side (``--pipeline on|prefer``).

Stage side: every ``--stage PATH[@FIRST-LAST]`` is fingerprinted at start (a bad one fails the start with
a one-line reason), advertised in this node's membership record (``stages``: fingerprint, free memory,
pin) and served on PIPELINE streams by ``engine.pipeline.stage.StageHost``, which loads only the layers a
serving node asks for.

Serving side: the API service asks :meth:`PipelineService.backend` for each engine model it serves. A
``Serving`` reads the stage offers from gossip, plans (``engine.pipeline.planner.make_plan``), opens the
plan's stage links as a ``Run`` and hands new sequences to the newest run (the plan changes only between
requests: a running sequence stays on its run). It re-plans every ``REPLAN_S``, on membership changes and
when a stage fails; a failed stage is left out for ``FAILED_RETRY_S`` or until it reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from engine import numerics
from engine.pipeline import direct, limits, wire
from engine.pipeline.client import PipelinedModel, PipelineUnavailable, Run, StageFailed, StageLink
from engine.pipeline.layout import embed_bytes, fingerprint, need_of
from engine.pipeline.planner import Need, Offer, Plan, PlanError, Stage, make_plan
from engine.pipeline.stage import StageHost
from meshd.errors import UsageError
from meshd.pipeline_direct import DirectDialer

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT_S = 5.0  # reaching an advertised stage node before its plan is given up
LOADING_FIELD = "stages_loading"  # record field: how many --stage checkpoints this node is still loading
LOADING_ANSWER_S = 10.0  # a stream opened to a stage still loading must send its first frame within this


class PipelineStartError(UsageError):
    """A ``--stage`` spec cannot be served; the message names it (exit 2)."""


def parse_stage_spec(spec: str) -> tuple[str, tuple[int, int] | None]:
    """``PATH[@FIRST-LAST]`` -> (path, pin). Raises ``PipelineStartError``."""
    path, at, rng = spec.rpartition("@") if "@" in spec else (spec, "", "")
    if not at:
        return spec, None
    first, dash, last = rng.partition("-")
    if not dash or not first.isdigit() or not last.isdigit() or int(first) > int(last):
        raise PipelineStartError(
            f"--stage {spec}: expected PATH@FIRST-LAST with FIRST <= LAST, e.g. /models/m@0-11"
        )
    return path, (int(first), int(last))


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 if unknown: such a node offers nothing unless --pipeline-memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class _Prefixed:
    """A stream whose first bytes were already read (to pick the stage host by fingerprint)."""

    def __init__(self, stream: Any, head: bytes) -> None:
        self._s = stream
        self._head: bytes | None = head

    async def recv(self) -> bytes | None:
        if self._head is not None:
            head, self._head = self._head, None
            return head
        return await self._s.recv()  # type: ignore[no-any-return]

    def set_receiver(self, on_data: Any, on_end: Any) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            on_data(head)
        self._s.set_receiver(on_data, on_end)

    async def send(self, data: bytes, end: bool = False) -> None:
        await self._s.send(data, end)

    def send_now(self, data: bytes) -> bool:
        return bool(self._s.send_now(data))

    async def end(self) -> None:
        await self._s.end()

    def reset(self, code: int = 0) -> None:
        self._s.reset(code)


class Serving:
    """One model served over a pipeline: the ``RunProvider`` of its ``PipelinedModel``. Loop thread unless
    noted."""

    def __init__(
        self,
        svc: PipelineService,
        name: str,
        model: Any,
        fp: bytes,
        need: Need,
        mode: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.svc = svc
        self.name = name
        self.model = model
        self.fp = fp
        self.need = need
        self.mode = mode
        self.loop = loop
        self.current_run: Run | None = None
        self.reason: str | None = "no plan yet"
        self.fallback: str | None = None  # prefer: why this node runs the model alone
        self.refused: list[tuple[str, str]] = []
        self.loading: list[str] = []  # stage nodes still loading their --stage checkpoints (gossip)
        self.runs: dict[int, Run] = {}
        self.failed: dict[str, float] = {}  # node id -> loop time it may be planned again
        self.recoveries = 0
        self.last_recovery_ms: float | None = None
        self.retrying: set[str] = set()  # failed stages asked once more: a short OPEN silence limit
        self._failing_since: float | None = None  # loop time plans started failing (None: they work)
        self._lock = asyncio.Lock()
        self.pipelined: PipelinedModel | None = None  # set by PipelineService.backend (status: decode timings)

    # --- RunProvider (scheduler thread) --------------------------------------------------------------

    def current(self) -> Run:
        run = self.current_run
        if run is not None and not run.dead:
            return run
        return self.run_on_loop(self._ensure())  # type: ignore[no-any-return]

    def recover(self, failed: Run, error: StageFailed) -> Run:
        return self.run_on_loop(self._recover(failed, error))  # type: ignore[no-any-return]

    def run_on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=limits.OPEN_TIMEOUT_S * 2)

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def release(self, run: Run, seq: int) -> None:
        self.loop.call_soon_threadsafe(self._release, run, seq)

    # --- loop side -----------------------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        run = self.current_run
        return None if run is not None and not run.dead else self.reason

    def _release(self, run: Run, seq: int) -> None:
        if seq not in run.seqs:
            return
        run.seqs.discard(seq)
        for link in run.links:
            link.free(run.id, [seq])
        self._retire(run)

    def _retire(self, run: Run) -> None:
        if run is not self.current_run and not run.seqs and run.id in self.runs:
            del self.runs[run.id]
            run.close("retired")
            log.info("pipeline_run_retired", model=self.name, run=f"{run.id:016x}")

    async def _ensure(self) -> Run:
        await self.replan()
        run = self.current_run
        if (run is None or run.dead) and self.failed:
            # nothing works without the stages that failed lately: ask them once more (one that was only
            # slow, e.g. descheduled on an overloaded machine, serves again; a dead one fails its OPEN
            # within SILENCE_S)
            self.retrying = set(self.failed)
            self.failed.clear()
            try:
                await self.replan()
            finally:
                self.retrying = set()
            run = self.current_run
        if run is None or run.dead:
            raise PipelineUnavailable(f"model '{self.name}' has no pipeline: {self.reason}")
        return run

    async def _recover(self, failed: Run, error: StageFailed) -> Run:
        t0 = time.perf_counter()
        if error.node_id:
            self.failed[error.node_id] = self.loop.time() + limits.FAILED_RETRY_S
        first = not failed.dead or failed.id in self.runs  # the first sequence to report this run's failure
        if not failed.dead:
            failed.dead = True
            failed.dead_reason = str(error)
            log.warning(
                "pipeline_stage_failed",
                model=self.name,
                run=f"{failed.id:016x}",
                node=error.node_id[:12],
                reason=error.reason,
            )
            failed.close("a stage failed")  # survivors free the run's state when its streams end
        self.runs.pop(failed.id, None)
        run = await self._ensure()
        if first:
            self.recoveries += 1
            self.last_recovery_ms = round((time.perf_counter() - t0) * 1e3, 1)
        log.info(
            "pipeline_recovered",
            model=self.name,
            run=f"{run.id:016x}",
            plan=run.plan.describe(),
            replan_ms=self.last_recovery_ms,
        )
        return run

    def forget_failure(self, node_id: str) -> None:
        self.failed.pop(node_id, None)

    async def replan(self) -> None:
        """Plan from gossip; open the plan's run if it differs from the current one (new sequences use it)."""
        async with self._lock:
            for _ in range(4):  # a stage that refuses OPEN is left out and the plan made again
                plan = self._plan()
                cur = self.current_run
                if cur is not None and not cur.dead and any(lk.closed for lk in cur.links):
                    cur.dead, cur.dead_reason = True, "a stage link closed"  # e.g. the stage restarted
                    cur.close(cur.dead_reason)
                now = self.loop.time()
                if plan is None:  # new requests get the reason (503); running sequences finish on their run
                    if self._failing_since is None:
                        self._failing_since = now
                    if cur is not None and not cur.dead and now - self._failing_since < limits.PLAN_GRACE_S:
                        return  # gossip flaps (a stage that just rejoined): keep a working run a moment
                    self.current_run = None
                    if cur is not None:
                        self._retire(cur)
                    return
                self._failing_since = None
                if cur is not None and not cur.dead and cur.plan.stages == plan.stages and not self._off_lane(cur):
                    return
                try:
                    run = await self._open(plan)
                except StageFailed as e:
                    self.failed[e.node_id] = self.loop.time() + limits.FAILED_RETRY_S
                    if e.code in (wire.ErrorCode.FINGERPRINT_MISMATCH, wire.ErrorCode.NUMERICS_MISMATCH):
                        self.refused.append((e.node_id, e.reason))
                    log.warning(
                        "pipeline_stage_refused", model=self.name, node=e.node_id[:12], reason=e.reason
                    )
                    self.reason = str(e)
                    continue
                self.current_run = run
                self.runs[run.id] = run
                self.reason = None
                self.svc.attach_direct(run)
                log.info("pipeline_planned", model=self.name, run=f"{run.id:016x}", plan=plan.describe())
                if cur is not None:
                    self._retire(cur)
                return

    def _off_lane(self, run: Run) -> bool:
        """Whether a stage link of ``run`` runs over QUIC while a data lane to that stage is up now. A run
        opened before the lane came up (planned right after the stage joined; on a loaded machine the lane
        can take a second more) stayed on QUIC for its life, without a direct channel (those need the lane):
        the plan is then opened again, over the lane, for new sequences. Not a link whose lane was up when
        the run was opened: the lane was full then (its stream limit; the transport falls back to QUIC), and
        opening again would only find it full again, once per re-plan, each time a new run on every stage."""
        from transport.stream_api import PATH_LANE

        tried = getattr(run, "lane_was_up", frozenset())
        for lk in run.links:
            if lk.node_id not in tried and self._lane_up(lk.node_id) and getattr(lk.channel, "path", None) != PATH_LANE:
                return True
        return False

    def _lane_up(self, node_id: str) -> bool:
        from transport.stream_api import PATH_LANE

        transport = self.svc.transport
        peer = transport.peer(node_id) if transport is not None else None
        return getattr(peer, "path", None) == PATH_LANE

    def _plan(self) -> Plan | None:
        now = self.loop.time()
        self.failed = {n: t for n, t in self.failed.items() if t > now}
        me = self.svc.node_id
        local = Offer(me, self.need.fingerprint, max(0, self.svc.offered_bytes() - embed_bytes(self.model)),
                      numerics=numerics.tag())
        offers = [o for o in self.svc.offers() if o.node_id not in self.failed]
        self.loading = self.svc.loading_stages()
        try:
            plan = make_plan(self.need, local, offers)
        except PlanError as e:
            self.refused = list(e.refused)
            reason = e.reason
            if self.loading:  # not offers yet: say they are coming, so a 503 is not read as "no stages"
                reason += (f"; still loading their --stage weights (used once they advertise them): "
                           f"{', '.join(n[:12] for n in self.loading)}")
            if self.mode == "prefer":
                self.fallback = reason
                return Plan((Stage(me, 0, self.need.num_layers - 1),))
            self.reason = reason
            return None
        self.refused = list(plan.refused)
        self.fallback = None
        return plan

    async def _open(self, plan: Plan) -> Run:
        run_id = int.from_bytes(os.urandom(8), "little")
        here = plan.stages[0]
        local = self.model.part(here.first, here.last) if here.layers else self.model.part(0, -1)
        links: list[StageLink] = []
        lane_was_up: set[str] = set()
        try:
            for st in plan.stages[1:]:
                quick = st.node_id in self.retrying  # a failed stage asked again: a client is waiting
                wait_s = limits.SILENCE_S if quick else CONNECT_TIMEOUT_S
                lane_up = self._lane_up(st.node_id)
                channel = await self.svc.open_stream(st.node_id, wait_s)
                if lane_up:
                    lane_was_up.add(st.node_id)
                link = StageLink(st.node_id, channel, st.first, st.last)
                links.append(link)
                await link.open(
                    run_id,
                    self.fp,
                    self.need.num_layers,
                    silence_s=limits.SILENCE_S if quick else limits.OPEN_SILENCE_S,
                )
        except StageFailed:
            for link in links:
                link.close("plan abandoned")
            raise
        run = Run(run_id, plan, local, links)
        run.lane_was_up = frozenset(lane_was_up)  # type: ignore[attr-defined]
        return run

    def status(self) -> dict[str, Any]:
        run = self.current_run
        out: dict[str, Any] = {
            "mode": self.mode,
            "fingerprint": self.fp.hex()[:16],
            "plan": run.plan.describe() if run is not None and not run.dead else None,
            "run": f"{run.id:016x}" if run is not None else None,
            "unavailable": self.unavailable_reason(),
            "local_fallback": self.fallback,
            "refused": [{"node_id": n, "reason": r} for n, r in self.refused],
            "loading": list(self.loading),
            "recoveries": self.recoveries,
            "last_recovery_ms": self.last_recovery_ms,
            "decode": self.pipelined.decode_status() if self.pipelined is not None else None,
            "runs": {
                f"{r.id:016x}": {
                    "live_sequences": len(r.seqs),
                    "dead": r.dead,
                    "stages": [
                        {
                            "node_id": lk.node_id,
                            "layers": [lk.first, lk.last],
                            "rtt_ms": self.svc.rtt_ms(lk.node_id),
                            "path": getattr(lk.channel, "path", None),  # quic | lane | relay
                            "direct": lk.direct is not None and not lk.direct.closed,
                            **lk.stats.as_dict(),
                        }
                        for lk in r.links
                    ],
                }
                for r in self.runs.values()
            },
        }
        return out


class PipelineService:
    """See the module docstring. ``start(daemon)`` needs ``daemon.transport``."""

    name = "pipeline"

    def __init__(self, stages: Sequence[str] = (), mode: str = "off", memory_mb: float = 0.0) -> None:
        self.specs = list(stages)
        self.mode = mode
        self.memory_mb = memory_mb
        self.hosts: list[StageHost] = []
        self.serving: list[Serving] = []
        self.transport: Any = None
        self.node_id = ""
        self._membership: Any = None
        self._state_dir: Path | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._kept: set[str] = set()
        self._collector: Any = None
        self._loading: str | None = None  # while the --stage checkpoints load: what an OPEN is answered
        self.directs = DirectDialer(self)  # the serving side's direct channels to stages

    @classmethod
    def from_config(cls, config: Any) -> PipelineService:
        return cls(tuple(config.stages), config.pipeline, config.pipeline_memory_mb)

    def offered_bytes(self) -> int:
        return int(self.memory_mb * 1_000_000) if self.memory_mb else available_bytes()

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self, daemon: Any) -> None:
        from transport.streams import StreamType

        self.transport = getattr(daemon, "transport", daemon)
        self.node_id = str(
            getattr(daemon, "node_id", "")
            or getattr(getattr(self.transport, "identity", None), "node_id", "")
        )
        self._state_dir = getattr(getattr(daemon, "state", None), "path", None) or getattr(
            getattr(daemon, "config", None), "state_dir", None
        )
        self._membership = _find_membership(daemon)
        if self.specs:
            # the daemon is in its mesh already, and hashing a big checkpoint the first time takes tens of
            # seconds: say so in gossip (no offer is planned on before it is published) and answer an OPEN
            # meanwhile with LOADING instead of leaving the stream without a handler
            self._loading = f"--stage {', '.join(self.specs)}: the weights are still being mapped and checked"
            self.transport.on_stream(StreamType.PIPELINE, self._serve)
            self._set_field(LOADING_FIELD, len(self.specs))
            try:
                self.hosts = await asyncio.to_thread(self._load_hosts, _experts_for(daemon))
            finally:
                self._loading = None
            lanes = getattr(self.transport, "lane", None)  # transport.lane.LaneManager (the lane service)
            if lanes is not None:
                from transport.lane_direct import SERVICE_PIPELINE

                hosts = self.hosts
                lanes.direct_handlers[SERVICE_PIPELINE] = lambda peer, ch: direct.serve(hosts, peer.node_id, ch)
            for h in self.hosts:
                log.info(
                    "pipeline_stage_ready",
                    path=str(h.path),
                    fingerprint=h.fingerprint.hex()[:16],
                    pin=list(h.pin) if h.pin else None,
                    offered_mb=round(self.offered_bytes() / 1e6, 3),
                )
        if self._membership is not None:
            if self.hosts:
                self._publish()
            self._membership.on_change(lambda _e: self._wake.set())
        self.transport.on_peer_up.append(self._peer_up)
        lanes = getattr(self.transport, "lane", None)
        if lanes is not None:  # a lane up: a run on QUIC to that stage moves onto it (Serving._off_lane)
            lanes.on_path_change.append(self._path_changed)
        self._spawn(self._loop())

    def _load_hosts(self, experts: Any) -> list[StageHost]:
        hosts = []
        for spec in self.specs:
            path_text, pin = parse_stage_spec(spec)
            path = Path(path_text)
            if path_text == "tiny":
                if self._state_dir is None:
                    raise PipelineStartError("--stage tiny needs a state directory")
                from engine.tiny import ensure_tiny

                path = ensure_tiny(self._state_dir)
            try:
                from engine.config import ModelConfig
                from engine.gguf_file import is_gguf, load_gguf

                cfg = load_gguf(path).config if is_gguf(path) else ModelConfig.load(path)
                if pin is not None and pin[1] >= cfg.num_layers:
                    raise PipelineStartError(f"--stage {spec}: the model has layers 0-{cfg.num_layers - 1}")
                fp = fingerprint(path, cache_dir=self._state_dir)  # cached there across restarts
            except PipelineStartError:
                raise
            except Exception as e:  # noqa: BLE001 - config/checkpoint errors, named
                raise PipelineStartError(f"--stage {spec}: {e}") from None
            hosts.append(StageHost(path, fp, pin, executor_for=experts))
        return hosts

    def _publish(self) -> None:
        try:
            from meshd.membership.records import StageOffer
        except ImportError:
            return
        free_kb = self.offered_bytes() // 1000
        with contextlib.suppress(AttributeError):
            self._membership.set_local_stages(
                [StageOffer(h.fingerprint.hex(), free_kb, h.pin) for h in self.hosts]
            )
            self._membership.set_local_field("numerics", numerics.tag())  # beside the offers (engine/numerics.py)
        self._set_field(LOADING_FIELD, None)

    def _set_field(self, key: str, value: Any) -> None:
        if self._membership is not None:
            with contextlib.suppress(AttributeError):
                self._membership.set_local_field(key, value)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.serving:
            for run in list(s.runs.values()):
                run.close("stopping")
        self.directs.close()
        if self.transport is not None:
            with contextlib.suppress(ValueError):
                self.transport.on_peer_up.remove(self._peer_up)
            with contextlib.suppress(ValueError, AttributeError):
                self.transport.lane.on_path_change.remove(self._path_changed)
            for node in self._kept:
                with contextlib.suppress(Exception):
                    self.transport.forget(node)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _loop(self) -> None:
        """Sweep idle stage caches; re-plan served models on membership changes and every ``REPLAN_S``."""
        last_sweep = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), limits.REPLAN_S)
            self._wake.clear()
            now = time.monotonic()
            if now - last_sweep >= limits.SWEEP_S:
                last_sweep = now
                for h in self.hosts:
                    h.sweep(now)
            for s in self.serving:
                try:
                    await s.replan()
                except Exception as e:  # noqa: BLE001 - planning must never stop the loop
                    log.warning("pipeline_replan_failed", model=s.name, error=repr(e))
                if s.current_run is not None and not s.current_run.dead:
                    self.attach_direct(s.current_run)  # a channel that closed is dialled again

    def _path_changed(self, peer: Any) -> None:
        """A lane came up: a run on QUIC to that peer may move onto it (``Serving._off_lane``). A lane going
        down wakes nothing: a stage killed mid-stream drops its lane at once, and a re-plan then, with gossip
        still listing the stage, would OPEN on it and hold the plan lock until membership declares it dead
        (2.6 s of a recovery that takes 0.4 s when the failing step reports the stage first)."""
        from transport.stream_api import PATH_LANE

        if self.serving and getattr(peer, "path", None) == PATH_LANE:
            self._wake.set()

    def _peer_up(self, peer: Any) -> None:
        for s in self.serving:
            s.forget_failure(peer.node_id)  # a restarted stage may serve again
        self._wake.set()

    def attach_direct(self, run: Run) -> None:
        """Direct channels for ``run``'s stage links (``meshd.pipeline_direct``). Loop thread."""
        self.directs.attach(run)

    # --- stage side --------------------------------------------------------------------------------

    async def _serve(self, peer: Any, stream: Any) -> None:
        if not self.hosts:  # still loading (start): an OPEN is told so, by the typed error LOADING
            await _answer_loading(stream, self._loading or "the stage is not ready")
            return
        dec = wire.FrameDecoder()
        head = b""
        while True:
            data = await stream.recv()
            if data is None:
                return
            head += data
            try:
                frames = dec.feed(data)
            except wire.RemoteProtocolError:
                frames = [None]
            if frames:
                break
        first = frames[0]
        host = self.hosts[0]
        if isinstance(first, wire.Open):  # the checkpoint's host, the one pinned to that range if several
            same = [h for h in self.hosts if h.fingerprint == first.fingerprint] or [host]
            host = next((h for h in same if h.pin == (first.first, first.last)), same[0])
        await host.serve(_Prefixed(stream, head), peer.node_id)

    # --- serving side ------------------------------------------------------------------------------

    def offers(self) -> list[Offer]:
        """Stage offers from gossip (alive peers), with each peer's measured round trip."""
        if self._membership is None:
            return []
        out = []
        for view in self._membership.alive_peers():
            rec = view.record
            for st in getattr(rec, "stages", ()) or ():
                peer = self.transport.peer(view.node_id) if self.transport is not None else None
                rtt = getattr(peer, "rtt_ms", None) if peer is not None else None
                out.append(
                    Offer(
                        view.node_id,
                        st.model_fingerprint,
                        st.free_kb * 1000,
                        st.pin,
                        rtt / 1e3 if isinstance(rtt, int | float) else None,
                        numerics=numerics.from_record((getattr(rec, "extra", None) or {}).get("numerics")),
                    )
                )
        return out

    def loading_stages(self) -> list[str]:
        """Alive peers whose ``--stage`` checkpoints are still being mapped and checked (gossip field
        ``stages_loading``): not offers yet, named in a failing plan's reason and in status."""
        if self._membership is None:
            return []
        out = []
        for view in self._membership.alive_peers():
            rec = view.record
            n = (getattr(rec, "extra", None) or {}).get(LOADING_FIELD)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0 and not getattr(rec, "stages", ()):
                out.append(view.node_id)
        return sorted(out)

    def rtt_ms(self, node_id: str) -> float | None:
        """The transport's smoothed round trip to a node (QUIC's estimate), if connected."""
        peer = self.transport.peer(node_id) if self.transport is not None else None
        rtt = getattr(peer, "rtt_ms", None) if peer is not None else None
        return round(rtt, 3) if isinstance(rtt, int | float) else None

    async def open_stream(self, node_id: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
        """A PIPELINE stream to ``node_id``, connecting through its advertised addresses if needed."""
        from meshd.mesh.links import parse_addr  # membership's (loaded already), not the experts service's
        from transport.streams import StreamType

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        peer = self.transport.peer(node_id)
        if (
            (peer is None or not peer.connected)
            and node_id not in self._kept
            and self._membership is not None
        ):
            rec = self._membership.record(node_id)
            addrs = [a for a in (parse_addr(x) for x in getattr(rec, "addrs", ())) if a is not None]
            if addrs:
                self._kept.add(node_id)
                self.transport.keep_connected(node_id, addrs)
        while (peer is None or not peer.connected) and loop.time() < deadline:
            await asyncio.sleep(0.05)
            peer = self.transport.peer(node_id)
        if peer is None or not peer.connected:
            raise StageFailed(node_id, f"not reachable within {timeout_s:g} s")
        try:
            return await peer.open_stream(StreamType.PIPELINE)
        except Exception as e:  # noqa: BLE001
            raise StageFailed(node_id, f"cannot open a stream: {e!r}") from None

    async def backend(self, loaded: Any, executor: Any = None, max_active: int | None = None) -> Any:
        """An API backend for ``loaded`` whose layers run on a pipeline (``--pipeline on|prefer``)."""
        from engine.scheduler import DEFAULT_MAX_ACTIVE, Scheduler
        from meshd.api.engine_backend import EngineBackend, PipelineSource

        fp = await asyncio.to_thread(fingerprint, loaded.path)  # computed by load_engine_model: a cache hit
        await asyncio.to_thread(numerics.tag)  # computed once, off the loop (it may import the kernels)
        need = need_of(loaded.model, fp)
        serving = Serving(self, loaded.name, loaded.model, fp, need, self.mode, asyncio.get_running_loop())
        self.serving.append(serving)
        await serving.replan()
        model = PipelinedModel(loaded.model, serving)
        serving.pipelined = model
        sched = Scheduler(
            model,
            loaded.tokenizer,
            max_active or DEFAULT_MAX_ACTIVE,
            name=loaded.name,
            executor=executor,
            batching="always",
        )
        log.info(
            "pipeline_model_ready",
            model=loaded.name,
            mode=self.mode,
            layers=need.num_layers,
            fingerprint=fp.hex()[:16],
        )
        return EngineBackend(
            PipelineSource(
                loaded.name, model, loaded.tokenizer, sched, fp.hex()[:16], executor=executor, serving=serving
            )
        )

    # --- telemetry ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pipeline": self.mode}
        if self.hosts or self.serving:
            out["numerics"] = numerics.tag()
        if self.hosts:
            out["stages"] = [h.status() for h in self.hosts]
        if self._loading is not None:
            out["loading"] = self._loading
        if self.serving:
            out["models"] = {s.name: s.status() for s in self.serving}
        return {"pipeline": out}

    def prometheus_collectors(self) -> list[Any]:
        if self._collector is None:
            from meshd.pipeline_metrics import collector

            self._collector = collector(self)
        return [self._collector]


async def _answer_loading(stream: Any, reason: str) -> None:
    """Answer the first bytes on ``stream`` (a serving node's OPEN) with ``ERROR(LOADING, reason)`` and end it,
    without buffering or parsing anything (whatever was asked, the answer is the same); nothing within
    ``LOADING_ANSWER_S`` resets it. Never raises."""
    try:
        async with asyncio.timeout(LOADING_ANSWER_S):
            if await stream.recv() is not None:
                text = f"stage node is still loading: {reason}"
                await stream.send(wire.encode(wire.Error(0, wire.ErrorCode.LOADING, text)), end=True)
                return
    except Exception as e:  # noqa: BLE001 - a bad or silent peer: reset below
        log.debug("pipeline_loading_answer_failed", error=repr(e))
    with contextlib.suppress(Exception):
        stream.reset(0)


def _find_membership(daemon: Any) -> Any:
    for svc in getattr(daemon, "services", []) or []:
        if all(hasattr(svc, a) for a in ("alive_peers", "on_change", "record")) and hasattr(
            svc, "set_local_models"
        ):
            return svc
    return None


def _experts_for(daemon: Any) -> Any:
    """For a stage that delegates its routed experts (``--remote-experts``): part -> its executor."""
    cfg = getattr(daemon, "config", None)
    if getattr(cfg, "remote_experts", "off") == "off":
        return None  # before the import: a stage that does not delegate never loads the experts code
    from meshd.experts_service import experts_of

    experts = experts_of(daemon)
    if experts is None:
        return None

    async def make(part: Any) -> Any:
        return await experts.executor_for(part.path, part.expert_weights)

    return make


def pipeline_of(daemon: Any) -> PipelineService | None:
    for svc in getattr(daemon, "services", []) or []:
        if isinstance(svc, PipelineService):
            return svc
    return None
