"""`meshd status` (text) shows expert workers, the direct channels to them and the workers refused with the
reason (another checkpoint, other numerics), and on a worker the shards it holds; before it showed nothing
of experts, so a refused worker was visible only in --json."""

from __future__ import annotations

from meshd.commands.status import format_status
from meshd.commands.status_experts import _ranges

W1 = "1" * 32
W2 = "2" * 32
REASON = (
    "expert worker " + W2 + " refused: computes with other numerics: kernels numpy on the worker, "
    "numba-0.68.1+int on the coordinator"
)


def _coordinator() -> dict:
    return {
        "node_id": "a" * 32,
        "state": "running",
        "services": {
            "experts": {
                "remote_experts": "on",
                "numerics": "kernels=numpy;numpy=2.4.6;blas=x:Haswell",
                "coordinators": [
                    {
                        "path": "/models/q3",
                        "mode": "on",
                        "covered": False,
                        "workers": {
                            W1: {
                                "connected": True,
                                "direct": True,
                                "calls": 40,
                                "direct_calls": 38,
                                "latency_ms_avg": 0.5,
                                "compute_ms_avg": 0.25,
                                "latency_ms_max": 3.0,
                                "errors": 0,
                            },
                            W2: {
                                "connected": False,
                                "direct": False,
                                "calls": 0,
                                "direct_calls": 0,
                                "latency_ms_avg": 0.0,
                                "compute_ms_avg": 0.0,
                                "latency_ms_max": 0.0,
                                "errors": 1,
                            },
                        },
                        "refused": {W2: REASON},
                    }
                ],
            }
        },
    }


def test_text_status_shows_workers_direct_channels_and_refusals() -> None:
    lines = format_status(_coordinator()).splitlines()
    assert "experts   remote on" in lines
    assert "  numerics kernels=numpy;numpy=2.4.6;blas=x:Haswell" in lines
    assert "  model /models/q3: mode on, not every expert has a live worker" in lines
    w1 = next(x for x in lines if x.strip().startswith(W1))
    assert w1.split() == [W1, "yes", "yes", "40", "38", "0.50", "0.25", "3.00", "0"], w1
    w2 = next(x for x in lines if x.strip().startswith(W2))
    assert w2.split()[:3] == [W2, "no", "no"], w2
    assert f"    refused {W2}: {REASON}" in lines


def test_text_status_shows_a_workers_shards_and_omits_the_section_otherwise() -> None:
    st = {
        "node_id": "b" * 32,
        "state": "running",
        "services": {
            "experts": {
                "remote_experts": "off",
                "numerics": "kernels=numpy",
                "worker": {
                    "requests": 7,
                    "errors": 0,
                    "shards": [
                        {
                            "path": "/models/q3",
                            "fingerprint": "5bfa25e0fd71e23922c2d54e70dc",
                            "layers": [0, 1, 2, 3],
                            "experts": [4, 5, 6, 7, 9],
                        }
                    ],
                },
            }
        },
    }
    lines = format_status(st).splitlines()
    assert "  worker: requests 7, errors 0" in lines
    shard = next(x for x in lines if x.strip().startswith("/models/q3"))
    assert shard.split() == ["/models/q3", "5bfa25e0fd71e239", "0-3", "4-7,9"], shard
    st["services"]["experts"] = {"remote_experts": "off"}  # neither coordinator nor worker
    assert "experts" not in format_status(st)


def test_ranges() -> None:
    assert _ranges([]) == "-"
    assert _ranges([3]) == "3"
    assert _ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert _ranges(None) == "-"
