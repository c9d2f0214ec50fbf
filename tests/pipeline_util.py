"""In-process pipeline fixtures: stage hosts on real socket pairs, a plan-driven run provider."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path
from typing import Any

from engine.experts.channel import LoopThread, socketpair_channels
from engine.pipeline.client import PipelinedModel, PipelineUnavailable, Run, StageFailed, StageLink
from engine.pipeline.layout import fingerprint
from engine.pipeline.planner import Plan, Stage
from engine.pipeline.stage import StageHost

# The stage hosts' serve tasks of every provider, held as long as its loop thread: a test that drops a
# provider (a new one per plan) would otherwise leave its tasks referenced by nothing but the loop's weak set,
# and the garbage collector would destroy them pending ("Task was destroyed but it is pending!") in the middle
# of a later test; LoopThread.stop cancels them all.
_HELD: weakref.WeakKeyDictionary[LoopThread, list[Any]] = weakref.WeakKeyDictionary()


class InprocProvider:
    """A ``RunProvider`` over stage hosts in this process, each reached through a socket pair.

    ``plans`` is a list of plans (tuples of (node, first, last), node "local" first); the provider uses
    the first whose nodes are all alive; ``kill(node)`` breaks that node's channels and marks it dead."""

    def __init__(
        self, lt: LoopThread, model: Any, path: Path, plans: list[list[tuple[str, int, int]]]
    ) -> None:
        self.lt = lt
        self.model = model
        self.fp = fingerprint(path)
        self.hosts = {n: StageHost(path, self.fp) for plan in plans for n, _a, _b in plan[1:]}
        self.plans = plans
        self.dead: set[str] = set()
        self.run: Run | None = None
        self.released: list[tuple[int, int]] = []
        self.channels: dict[str, list[Any]] = {}
        self.tasks: list[Any] = _HELD.setdefault(lt, [])

    def current(self) -> Run:
        if self.run is None or self.run.dead:
            self.run = self.lt.run(self._open())
        return self.run

    async def _open(self) -> Run:
        for plan in self.plans:
            if any(n in self.dead for n, _a, _b in plan):
                continue
            links = []
            run_id = len(self.released) + 1000 + id(plan) % 997
            for n, a, b in plan[1:]:
                near, far = await socketpair_channels()
                self.channels.setdefault(n, []).extend([near, far])
                self.tasks.append(asyncio.ensure_future(self.hosts[n].serve(far, "coordinator")))
                link = StageLink(n, near, a, b)
                await link.open(run_id, self.fp, self.model.config.num_layers)
                links.append(link)
            _n0, a0, b0 = plan[0]
            local = self.model.part(a0, b0)
            return Run(run_id, Plan(tuple(Stage(n, a, b) for n, a, b in plan)), local, links)
        raise PipelineUnavailable("no plan left")

    def recover(self, failed: Run, error: StageFailed) -> Run:
        failed.dead = True
        failed.close("failed")
        if error.node_id:
            self.dead.add(error.node_id)
        self.run = None
        return self.current()

    def run_on_loop(self, coro: Any) -> Any:
        return self.lt.run(coro)

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.lt.loop)

    def release(self, run: Run, seq: int) -> None:
        self.released.append((run.id, seq))

        def free() -> None:
            for link in run.links:
                link.free(run.id, [seq])

        self.lt.loop.call_soon_threadsafe(free)

    def kill(self, node: str) -> None:
        """The stage process dies: its side of every channel goes away without a word."""
        self.dead.add(node)

        def breakall() -> None:
            for ch in self.channels.get(node, [])[1::2]:
                ch.reset(0)
            self.hosts[node].seqs.clear()

        self.lt.loop.call_soon_threadsafe(breakall)

    def pipelined(self) -> PipelinedModel:
        return PipelinedModel(self.model, self)
