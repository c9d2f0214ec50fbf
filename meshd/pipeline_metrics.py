"""The pipeline's `/metrics`: per-stage latency histograms and recoveries on the serving node, live
sequences on stage nodes (read from ``meshd.pipeline_service.PipelineService`` at scrape time)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshd.pipeline_service import PipelineService


def collector(svc: PipelineService) -> Any:
    """A prometheus_client collector of ``svc``'s per-stage latency, recoveries and live sequences."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    from engine.latency import LATENCY_BUCKETS_S

    class _Collector:
        def collect(self) -> Iterable[Any]:
            lat = HistogramMetricFamily(
                "meshd_pipeline_stage_latency_seconds",
                "Round trip of one step through a pipeline stage, seen by the serving node",
                labels=["model", "node", "layers"],
            )
            rec = CounterMetricFamily(
                "meshd_pipeline_recoveries", "Re-plans after a stage failed mid-generation", labels=["model"]
            )
            live = GaugeMetricFamily(
                "meshd_pipeline_live_sequences", "Sequences with state on this stage node", labels=["path"]
            )
            for s in svc.serving:
                rec.add_metric([s.name], s.recoveries)
                for run in s.runs.values():
                    for lk in run.links:
                        st = lk.stats
                        acc, buckets = 0, []
                        for b, n in zip(LATENCY_BUCKETS_S, st.buckets):
                            acc += n
                            buckets.append((repr(b), acc))
                        buckets.append(("+Inf", acc + st.buckets[-1]))
                        lat.add_metric(
                            [s.name, lk.node_id[:12], f"{lk.first}-{lk.last}"], buckets, st.latency_s
                        )
            for h in svc.hosts:
                live.add_metric([str(h.path)], h.live())
            return [lat, rec, live]

    return _Collector()
