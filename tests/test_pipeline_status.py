"""`meshd status` (text) shows the pipeline plan with per-stage timings and the stage ranges a node holds."""

from __future__ import annotations

from meshd.commands.status import format_status

SERVING = "a" * 32
STAGE = "c" * 32


def _status() -> dict:
    run = "00000000000000a1"
    return {
        "node_id": SERVING,
        "state": "running",
        "services": {
            "pipeline": {
                "pipeline": {
                    "pipeline": "on",
                    "numerics": "kernels=numpy;numpy=2.4.6;blas=x:Haswell",
                    "models": {
                        "m": {
                            "mode": "on",
                            "fingerprint": "f00dcafe12345678",
                            "plan": [
                                {"node_id": SERVING, "layers": [0, 3]},
                                {"node_id": STAGE, "layers": [4, 7]},
                            ],
                            "run": run,
                            "unavailable": None,
                            "local_fallback": None,
                            "refused": [{"node_id": "d" * 32, "reason": "other checkpoint"}],
                            "recoveries": 1,
                            "last_recovery_ms": 812.4,
                            "runs": {
                                run: {
                                    "live_sequences": 3,
                                    "dead": False,
                                    "stages": [
                                        {
                                            "node_id": STAGE,
                                            "layers": [4, 7],
                                            "rtt_ms": 2.5,
                                            "path": "lane",
                                            "direct": True,
                                            "path_rtt_ms_avg": 0.31,
                                            "calls": 120,
                                            "direct_calls": 117,
                                            "latency_ms_avg": 5.125,
                                            "compute_ms_avg": 4.5,
                                            "hop_overhead_ms_avg": 0.625,
                                            "latency_ms_max": 14.0,
                                        }
                                    ],
                                }
                            },
                        }
                    },
                    "stages": [
                        {
                            "path": "/models/m",
                            "fingerprint": "f00dcafe12345678",
                            "pin": [4, 7],
                            "loaded": [[4, 7]],
                            "live_sequences": 2,
                            "runs": {},
                            "steps": 99,
                            "compute_ms_avg": 4.5,
                        }
                    ],
                }
            }
        },
    }


def test_text_status_shows_the_plan_with_per_stage_timings() -> None:
    text = format_status(_status())
    lines = text.splitlines()
    assert "pipeline  on" in lines
    head = next(x for x in lines if x.strip().startswith("model m:"))
    assert "run 00000000000000a1" in head and "live sequences 3" in head, head
    me = next(x for x in lines if x.strip().startswith(SERVING))
    assert me.split() == [SERVING, "(this", "node)", "0-3", "-", "-", "-", "-", "-", "-", "-", "-"], me
    st = next(x for x in lines if x.strip().startswith(STAGE))
    assert st.split() == [STAGE, "4-7+head", "lane+direct", "0.31", "120", "117", "5.12", "4.50", "0.62", "14.00"], st
    assert any("refused " + "d" * 32 + ": other checkpoint" in x for x in lines)
    assert any("recoveries 1 (last 812 ms)" in x for x in lines)
    assert "  numerics kernels=numpy;numpy=2.4.6;blas=x:Haswell" in lines
    held = next(x for x in lines if x.strip().startswith("/models/m"))
    assert held.split() == ["/models/m", "f00dcafe12345678", "4-7", "4-7", "2", "99", "4.50"], held


def test_text_status_says_why_a_model_is_unavailable_and_omits_the_section_when_off() -> None:
    st = _status()
    m = st["services"]["pipeline"]["pipeline"]["models"]["m"]
    m.update(plan=None, run=None, runs={}, unavailable="layers 4-7 (264 MB) have no stage")
    text = format_status(st)
    assert "    unavailable: layers 4-7 (264 MB) have no stage" in text.splitlines()
    assert "NODE" not in text
    st["services"] = {}
    assert "pipeline" not in format_status(st)
