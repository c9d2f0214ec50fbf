"""The serving node's direct channels to its pipeline stages (``engine.pipeline.direct``): who gets one, when.

A stage link whose stream rides a data lane gets the direct channel this node has to that stage node, or one
dialled in the background (``LaneManager.dial_direct``, service ``SERVICE_PIPELINE``); one channel per stage
node, shared by every run's link to it. One that closed (a failure on it, the stage went away) is dialled again
``DIRECT_REDIAL_S`` later at the earliest, from the service's re-plan loop. Best effort: without one, steps go
on the stream. ``MESHD_PIPELINE_DIRECT=0`` dials none. Loop thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from engine.pipeline import direct, limits
from engine.pipeline.client import Run
from engine.pipeline.link import StageLink

log = structlog.get_logger(__name__)


class DirectDialer:
    """See the module docstring. ``svc``: the pipeline service (its transport, serving models, task spawner)."""

    def __init__(self, svc: Any) -> None:
        self.svc = svc
        self.hops: dict[str, direct.DirectHop] = {}  # stage node -> its direct channel
        self._dialling: set[str] = set()
        self._dial_after: dict[str, float] = {}  # stage node -> loop time it may be dialled again

    def attach(self, run: Run) -> None:
        """Give each of ``run``'s stage links that rides a data lane a direct channel to its stage."""
        if not direct.enabled():
            return
        for link in run.links:
            if link.direct is not None and not link.direct.closed or link.closed:
                continue
            hop = self.hops.get(link.node_id)
            if hop is not None and not hop.closed:
                link.direct = hop
            elif link.node_id not in self._dialling:
                self.svc._spawn(self._dial(link))

    async def _dial(self, link: StageLink) -> None:
        from transport.errors import TransportError
        from transport.lane_direct import SERVICE_PIPELINE
        from transport.stream_api import PATH_LANE

        node = link.node_id
        loop = asyncio.get_running_loop()
        old = self.hops.pop(node, None)
        if old is not None:  # it closed (a failure on it, or the stage went away): not at once again
            self._dial_after[node] = loop.time() + limits.DIRECT_REDIAL_S
        transport = self.svc.transport
        lanes = getattr(transport, "lane", None)
        peer = transport.peer(node) if transport is not None else None
        if (lanes is None or peer is None or getattr(link.channel, "path", None) != PATH_LANE
                or loop.time() < self._dial_after.get(node, 0.0)):
            return
        self._dialling.add(node)
        try:
            hop = direct.DirectHop(await lanes.dial_direct(peer, SERVICE_PIPELINE))
        except (TransportError, OSError) as e:
            self._dial_after[node] = loop.time() + limits.DIRECT_REDIAL_S
            log.info("pipeline_direct_unavailable", stage=node[:12], error=str(e))
            return
        finally:
            self._dialling.discard(node)
        self.hops[node] = hop
        log.info("pipeline_direct_up", stage=node[:12])
        for s in self.svc.serving:
            for r in s.runs.values():
                for lk in r.links:
                    if lk.node_id == node and not lk.closed and (lk.direct is None or lk.direct.closed):
                        lk.direct = hop

    def close(self) -> None:
        for hop in self.hops.values():
            hop.close("stopping")
