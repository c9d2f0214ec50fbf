"""Latency histograms shared by the distributed paths (expert workers, pipeline stages): one bucket set,
so their Prometheus histograms line up, and one place that files an observation."""

from __future__ import annotations

from bisect import bisect_left

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Upper bounds (seconds) of the per-call latency buckets; one more bucket holds everything above."""


def empty_buckets() -> list[int]:
    return [0] * (len(LATENCY_BUCKETS_S) + 1)


def observe(buckets: list[int], latency_s: float) -> None:
    """Count one call of ``latency_s`` in the first bucket whose bound is at least it (else the last)."""
    buckets[bisect_left(LATENCY_BUCKETS_S, latency_s)] += 1
