"""Recovery parity under batched decode (numba): the scenario of tests/test_pipeline_batch.py's scheduler test
(five requests through an in-process 3-stage split, stage s2 killed after request 0's sixth event, the
sequences replayed onto [serving node 0-1, s3 2-2]) run again and again, each run in a fresh process (the
flake shows in fresh processes: about 1 in 10-20 at load 10-15, none in 40 runs looped in one process).

For every run it prints ``ok`` or what differed from the lone local run: per request, the steps whose token
or logprob differ (a shorter list: the stream ended with an error), and for every sequence that was
replayed, the KV entries (layer, position, max |dk|, max |dv|) of its new caches (this node's layers and
s3's) that differ from a lone local run over the same history, and the frames s3 received for it (whether
each input equals this node's lone layer-range output). Diagnostics only: nothing is timed.

    python bench/replay_flake.py --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _checkpoint(tmp: Path) -> Path:
    from experts_util import make_moe_checkpoint

    from engine.tiny import create_tiny

    tiny = create_tiny(tmp / "tiny")
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    path = make_moe_checkpoint(tmp / "src", family="qwen3_moe", layers=3, experts=8, hidden=512, inter=512,
                               top_k=4, vocab=vocab, seed=5, dense_layers=(0,))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, path / name)
    return path


def child(path: Path, groups: str, kill_at: int, silence_s: float) -> None:
    import numpy as np
    from pipeline_util import InprocProvider

    from engine.decode_plan import forward_span
    from engine.experts.channel import LoopThread
    from engine.generate import generate
    from engine.model import Model
    from engine.moe import drive
    from engine.pipeline import client, stage
    from engine.sampling import SamplingParams
    from engine.scheduler import Scheduler
    from engine.tokenizer import Tokenizer

    os.environ["MESHD_PIPELINE_GROUPS"] = groups
    from engine.pipeline import limits

    limits.SILENCE_S = silence_s  # as the test: in-process stages share its loop and cores
    model, tok = Model.load(path), Tokenizer.load(path)
    ref = Model.load(path)  # the lone local run of a replayed history (its own plan and buffers)
    prompts = [tok.encode(p) for p in ("one two", "the mesh holds the layers of", "a", "seeded run", "b c")]
    params = [SamplingParams(max_tokens=14, temperature=0.0 if i % 2 else 0.8, seed=i, top_logprobs=2,
                             ignore_eos=True) for i in range(len(prompts))]
    want = []
    for p, ids in zip(params, prompts):
        evs = list(generate(model, tok, ids, p))
        want.append(([e.token_id for e in evs], [e.logprob for e in evs]))

    snaps: list[tuple] = []
    frames: list[tuple] = []
    prov_box: list[InprocProvider] = []
    orig_forward, orig_compute = client.PipelinedModel.forward, stage.StageHost._compute

    def forward(self, ids, cache, executor=None, *, last_only=False):  # type: ignore[no-untyped-def]
        before = cache.run
        out = orig_forward(self, ids, cache, executor, last_only=last_only)
        if cache.run is not before:  # recovered in this call: copy its new caches now, compare later
            run, n = cache.run, cache.length
            ent = prov_box[0].hosts["s3"].seqs.get((run.id, cache.seq))
            kv = [(k[:, :n].copy(), v[:, :n].copy()) for k, v in zip(cache.local.k, cache.local.v)]
            if ent is not None:
                kv += [(ent.cache.k[0][:, :n].copy(), ent.cache.v[0][:, :n].copy())]
            snaps.append((cache.seq, run.id, [h.copy() for h in cache.history], kv))
        return out

    def compute(self, part, executor, f, direct=False):  # type: ignore[no-untyped-def]
        out = orig_compute(self, part, executor, f, direct)
        frames.append((f.run, tuple((s.seq, s.start, s.count) for s in f.spans), threading.current_thread().name,
                       f.x.tobytes()))
        return out

    client.PipelinedModel.forward = forward  # type: ignore[method-assign]
    stage.StageHost._compute = compute  # type: ignore[method-assign]
    lt = LoopThread()
    prov = InprocProvider(lt, model, path, [[("local", 0, 0), ("s1", 1, 1), ("s2", 2, 2)],
                                            [("local", 0, 1), ("s3", 2, 2)]])
    prov_box.append(prov)
    sched = Scheduler(prov.pipelined(), tok, 8, batching="always")
    try:
        got = []
        for i, h in enumerate([sched.submit(ids, p) for ids, p in zip(prompts, params)]):
            evs = []
            for ev in h:
                evs.append(ev)
                if i == 0 and len(evs) == kill_at:
                    prov.kill("s2")
            got.append(([e.token_id for e in evs], [e.logprob for e in evs]))
    finally:
        sched.close()
        lt.stop()
    lines = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            steps = [j for j in range(len(g[0])) if g[0][j] != w[0][j] or g[1][j] != w[1][j]]
            delta = [float(g[1][j] or 0) - float(w[1][j]) for j in steps[:3]]
            lines.append(f"request {i}: {len(g[0])}/{len(w[0])} events, steps {steps} differ (logprob - local: {delta})")
    for seq, rid, hist, kv in snaps:
        rc = ref.new_cache(4)
        for ch in hist:
            ref.forward(ch, rc, last_only=True)
        diffs = [(layer, p, float(np.abs(k[:, p] - rc.k[layer][:, p]).max()),
                  float(np.abs(v[:, p] - rc.v[layer][:, p]).max()))
                 for layer, (k, v) in enumerate(kv) for p in range(rc.length)
                 if k[:, p].tobytes() != rc.k[layer][:, p].tobytes() or v[:, p].tobytes() != rc.v[layer][:, p].tobytes()]
        lines.append(f"replayed run {rid} seq {seq} chunks {[len(h) for h in hist]}: "
                     f"{'KV as local' if not diffs else f'KV differs (layer, pos, dk, dv): {diffs}'}")
        if diffs:  # what s3 got for it, against this node's lone layer-range outputs over the same history
            part = ref.part(0, 1)
            lc = part.new_cache(4)
            outs = []
            for ch in hist:
                x = ref.embed(ch)
                hx = forward_span(part, x, lc, None) if len(ch) == 1 else None
                if hx is None:
                    lc.reserve(lc.length + len(ch))
                    hx = drive(part.span_steps(x, lc, lc.length), part.local_executor, part.warm)
                lc.length += len(ch)
                outs.append(np.ascontiguousarray(hx).tobytes())
            mine = [fr for fr in frames if fr[0] == rid]
            for fr, o in zip(mine, outs):
                lines.append(f"  s3 frame {fr[1]} on {fr[2]}: input {'as local' if fr[3] == o else 'DIFFERS'}")
    bad = any(not ln.startswith("replayed") or "differs" in ln for ln in lines if not ln.startswith("  "))
    print(("FAIL\n" if bad else "ok\n") + "\n".join("  " + ln for ln in lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="fresh processes to run the scenario in (default: 20)")
    ap.add_argument("--groups", default="", help="MESHD_PIPELINE_GROUPS for the runs (default: '', one group "
                    "per process; the test also runs '1')")
    ap.add_argument("--kill-at", type=int, default=6, help="kill s2 after this many events of request 0, 0 never "
                    "(default: 6, as the test)")
    ap.add_argument("--silence-s", type=float, default=10.0, help="a stage silent this long is failed "
                    "(default: 10.0, as the test; the daemon's limits.SILENCE_S is 0.8)")
    ap.add_argument("--child", default="", help="internal: run one scenario on this checkpoint (default: '')")
    a = ap.parse_args()
    if a.child:
        child(Path(a.child), a.groups, a.kill_at, a.silence_s)
        return
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    with tempfile.TemporaryDirectory(prefix="replay-flake-") as tmp:
        path = _checkpoint(Path(tmp))
        fails = 0
        for i in range(a.runs):
            env = dict(os.environ, MESHD_LOG_LEVEL="error")
            res = subprocess.run([sys.executable, __file__, "--child", str(path), "--groups", a.groups,
                                  "--kill-at", str(a.kill_at), "--silence-s", str(a.silence_s)], check=False, capture_output=True, text=True, env=env)
            out = "\n".join(ln for ln in res.stdout.splitlines() if ln.startswith(("ok", "FAIL", "  ")))
            fails += out.startswith("FAIL") or res.returncode != 0
            print(f"run {i + 1}/{a.runs} (load {os.getloadavg()[0]:.1f}): {out or res.stderr[-500:]}", flush=True)
        print(f"{fails} of {a.runs} runs differed from local")


if __name__ == "__main__":
    main()
