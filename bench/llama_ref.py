"""llama.cpp as the reference for decode speed: how close our engine and llama.cpp come to the memory
bandwidth limit on this machine, on the same GGUF files, in the same run.

    python bench/llama_ref.py [--dir /tmp/compact-bench] [--forms F32,Q8_0,Q4_K_M] [--threads 2]
        [--rounds 7] [--blocks 4]

Needs llama-cpp-python (``pip install '.[llamaref]'``, which builds llama.cpp from source; set
``CMAKE_ARGS=-DGGML_NATIVE=ON`` for this CPU's instructions); without it the script says so and exits 2.
Not part of the test suite.

Uses ``bench/engine.py``'s checkpoint in ``--dir`` (written there when the directory has none) and its GGUF
forms ``model-<FORM>.gguf``, each written by our own ``engine.gguf_export`` when missing (``F32`` is the fp32
weights stored F32). For every form two sides run the same file: ``ours-FORM`` (this tree's engine,
``Model.load`` of the .gguf) and ``llama-FORM`` (llama.cpp through llama-cpp-python's C API: one context,
``n_ctx`` 512, its default KV cache type, ``n_threads`` = ``n_threads_batch`` = ``--threads``); one more side
is ``bench/engine.py``'s memory read bandwidth probe (1 GiB, one reader per thread, best of three).

Method (``bench/engine.py``'s): every side is its own process, loaded and warmed up once (one untimed prefill
and decode), one load at a time; then ``--rounds`` rounds. In a round every side prefills the same 256 token
ids (last position's logits only) one side at a time, timed; then every side prefills a fresh cache untimed and
the sides take turns decoding ``--blocks`` blocks of the 64 greedy steps (argmax of the last logits, in numpy,
on both sides), the probe once at the middle block, the order rotating by one side per round. A side not
being timed blocks on its stdin; each command starts 50 ms after the last (spinning helpers, llama.cpp's
OpenMP threads among them, have gone to sleep), and the run reports the CPU time the other sides used while
one was timed.

The limit: the weight bytes one decoded token reads from the file (every tensor whole, except the stacked
experts ``*_exps`` at top-k of E and one row of ``token_embd``) over the probe's bandwidth of the same round;
the same byte count for both sides of a form, so "of limit" compares them directly. ``ours / llama.cpp`` is
the per-round ratio of decode speeds, median [min-max].
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)  # bench/engine.py would shadow the engine package
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FORMS = ("F32", "Q8_0", "Q4_K_M")
ROUNDS = 7
N_CTX = 512


def _bench_engine():
    """bench/engine.py as a module (its sides, prompt, probe and timing helpers)."""
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "bench" / "engine.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EB = _bench_engine()


def active_bytes(path: Path) -> tuple[int, dict[str, int]]:
    """Weight bytes one decode step reads from GGUF ``path``; -> (bytes, {stored type: bytes})."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = str(r.fields["general.architecture"].contents())
    top_k = int(r.fields[f"{arch}.expert_used_count"].contents()) if f"{arch}.expert_used_count" in r.fields else 0
    n_exp = int(r.fields[f"{arch}.expert_count"].contents()) if f"{arch}.expert_count" in r.fields else 0
    total, by_type = 0, {}
    for t in r.tensors:
        b = int(t.n_bytes)
        if "_exps." in t.name and n_exp:
            b = b * top_k // n_exp
        elif t.name == "token_embd.weight":
            b //= int(t.shape[-1])  # ggml shape [n_embd, n_vocab]: one row of n_embd
        total += b
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + b
    return total, by_type


class _LlamaSide:
    """llama.cpp on one GGUF file through llama-cpp-python's C API, driven like bench/engine.py's sides."""

    def __init__(self, path: Path, threads: int) -> None:
        import ctypes

        import llama_cpp as lc
        import numpy as np

        self.lc, self.np, self.ctypes = lc, np, ctypes
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        t0 = time.perf_counter()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = N_CTX, EB.PROMPT_LEN, EB.PROMPT_LEN
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {path}")
        self.load_s = time.perf_counter() - t0
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model)) or EB.CONFIG["vocab_size"]
        self.prompt = EB._prompt(EB.PROMPT_LEN, 1)
        self._prompt_arr = (lc.llama_token * len(self.prompt))(*self.prompt)
        self._one = (lc.llama_token * 1)()

    def _clear(self) -> None:
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

    def _decode(self, arr, n: int) -> int:
        """Decode ``n`` tokens at the cache's end; -> argmax of the last position's logits."""
        lc = self.lc
        rc = lc.llama_decode(self.ctx, lc.llama_batch_get_one(arr, n))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = self.np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
        return int(logits.argmax())

    def prefill(self) -> float:
        self._clear()
        t0 = time.perf_counter()
        self._decode(self._prompt_arr, len(self.prompt))
        return time.perf_counter() - t0

    def decode(self) -> float:
        self.decode_begin()
        return self.decode_block(EB.DECODE_LEN)

    def decode_begin(self) -> float:
        self._clear()
        self.tok = self._decode(self._prompt_arr, len(self.prompt))
        return 0.0

    def decode_block(self, n: int) -> float:
        one, tok = self._one, self.tok
        t0 = time.perf_counter()
        for _ in range(n):
            one[0] = tok
            tok = self._decode(one, 1)
        dt = time.perf_counter() - t0
        self.tok = tok
        return dt

    def info(self) -> dict:
        lc = self.lc
        return {"peak_rss_mb": EB._peak_mb(), "load_s": self.load_s,
                "system": lc.llama_print_system_info().decode(errors="replace"),
                "version": getattr(lc, "__version__", "?")}


def _serve(kind: str, path: Path, threads: int, proto) -> None:
    if kind == "bandwidth":
        side = EB._BandwidthSide(path, threads)
        side.probe()
    else:
        side = _LlamaSide(path, threads) if kind == "llama" else EB._EngineSide(path, threads, ROOT)
        side.prefill()
        side.decode()
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "info":
            out = side.info()
            if kind == "engine":
                out["engine_active_bytes"] = EB._active_bytes(side.model)
        else:
            out = {"r": getattr(side, op)(*cmd.get("args", ()))}
        proto.write(json.dumps(out) + "\n")
        proto.flush()


class _Proc(EB._Proc):
    """One side's process (this script as its worker), alive for the whole run."""

    def __init__(self, kind: str, path: Path, threads: int) -> None:
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MESHD_KERNEL_THREADS"):
            env[var] = str(threads)
        from engine import BLAS_THREAD_TIMEOUT

        env.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
        self.kind = kind
        cmd = [sys.executable, __file__, "--worker", kind, "--dir", str(path), "--threads", str(threads)]
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        # the side's log (llama.cpp's is tens of KiB at load) drained from the start, so the pipe never
        # fills and blocks it; the last lines are kept for the error message
        import collections
        import threading

        self.log: collections.deque[str] = collections.deque(maxlen=8)
        threading.Thread(target=lambda: self.log.extend(self.p.stderr), daemon=True).start()
        line = self.p.stdout.readline() if self.p.stdout else ""
        if not line:
            code = self.p.wait()
            time.sleep(0.1)
            raise RuntimeError(f"side {kind} on {path} failed (exit {code}): {' | '.join(x.strip() for x in self.log)}")


def _forms(path: Path, forms: list[str]) -> dict[str, Path]:
    """``model-<FORM>.gguf`` of the checkpoint in ``path``, written by engine.gguf_export when missing."""
    import gguf

    out = {}
    for f in forms:
        g = path / f"model-{f}.gguf"
        if not g.exists():
            from engine.gguf_export import export_gguf

            export_gguf(path, g, f)
        if "tokenizer.ggml.model" not in gguf.GGUFReader(str(g)).fields:
            sys.exit(f"{g} has no tokenizer.ggml.model (written before gguf_export wrote 'none' for a checkpoint"
                     " without tokenizer), which llama.cpp refuses: delete it and it is written again")
        out[f] = g
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/compact-bench"),
                    help="bench/engine.py's checkpoint dir (written when it has none; default /tmp/compact-bench)")
    ap.add_argument("--forms", default=",".join(FORMS),
                    help=f"GGUF forms both sides run, model-<FORM>.gguf in --dir (default {','.join(FORMS)})")
    ap.add_argument("--threads", type=int, default=2, help="threads of every side (default 2)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds; medians [min-max] over them (default {ROUNDS})")
    ap.add_argument("--blocks", type=int, default=EB.BLOCKS,
                    help=f"blocks each side's {EB.DECODE_LEN} decode steps are split into (default {EB.BLOCKS})")
    ap.add_argument("--no-prefill", action="store_true", help="time decode only (default: prefill too)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        _serve(args.worker, args.dir, args.threads, out)
        return
    if importlib.util.find_spec("llama_cpp") is None:
        sys.stderr.write("bench/llama_ref.py needs llama-cpp-python: pip install '.[llamaref]'"
                         " (CMAKE_ARGS=-DGGML_NATIVE=ON builds llama.cpp for this CPU)\n")
        sys.exit(2)
    forms = [f for f in args.forms.split(",") if f]
    if not (args.dir / "config.json").exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        EB.create(args.dir)
    files = _forms(args.dir, forms)
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                    " from engine import dense, kernels; kernels.warm(); dense.warm_step()", str(ROOT)], check=False)
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    kinds: dict[str, tuple[str, Path]] = {"bandwidth": ("bandwidth", args.dir)}
    for f in forms:
        kinds[f"ours-{f}"] = ("engine", files[f])
        kinds[f"llama-{f}"] = ("llama", files[f])
    procs: dict[str, _Proc] = {}
    res: dict[str, dict] = {}
    idle: dict[str, list[float]] = {}
    loads = [load0]
    try:
        for name, (kind, p) in kinds.items():
            procs[name] = _Proc(kind, p, args.threads)
        t_loaded = time.perf_counter()
        res = {name: {"prefill": [], "decode": [], "probe": []} for name in procs}
        names = list(procs)
        blocks = max(1, min(args.blocks, EB.DECODE_LEN))
        steps = [EB.DECODE_LEN // blocks + (b < EB.DECODE_LEN % blocks) for b in range(blocks)]
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            if not args.no_prefill:
                for name in order:
                    if name != "bandwidth":
                        res[name]["prefill"].append(EB._timed(procs, name, idle, "prefill")["r"])
            for name in order:
                if name != "bandwidth":
                    procs[name].call("decode_begin")
            dec = {name: 0.0 for name in order}
            for b, n in enumerate(steps):
                for name in order[b % len(order):] + order[: b % len(order)]:
                    if name != "bandwidth":
                        dec[name] += EB._timed(procs, name, idle, "decode_block", n)["r"]
                    elif b == len(steps) // 2:
                        res[name]["probe"].append(EB._timed(procs, name, idle, "probe")["r"])
            for name in order:
                if name != "bandwidth":
                    res[name]["decode"].append(dec[name])
            loads.append(os.getloadavg()[0])
        for name, proc in procs.items():
            res[name]["info"] = proc.call("info")
    finally:
        for proc in procs.values():
            proc.close()
    sys.stdout.write(_report(args, forms, files, res, idle, loads, load0, t_start, t_loaded) + "\n")


def _report(args, forms, files, res, idle, loads, load0, t_start, t_loaded) -> str:
    med = EB._med
    bws = [x["read_gb_s"] for x in res["bandwidth"]["probe"]]
    bw = med(bws)
    n = EB.DECODE_LEN

    def rng(xs: list[float], fmt: str) -> str:
        return f"{med(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"

    idle_wall = sum(w for w, _ in idle.values())
    idle_cpu = sum(c for _, c in idle.values())
    worst = max(idle.items(), key=lambda kv: kv[1][1] / max(kv[1][0], 1e-9))
    lsys = next((res[f"llama-{f}"]["info"] for f in forms), {})
    lines = [
        f"every side in its own process, loaded once, then {args.rounds} rounds (prefills one side at a time,"
        f" then each side's {n}-step decode in {args.blocks} blocks, the sides taking turns, the probe at the middle"
        f" block; order rotating per round); load average {load0:.1f} -> {os.getloadavg()[0]:.1f}"
        f" (max {max(loads):.1f}); loads {t_loaded - t_start:.0f} s, rounds {time.perf_counter() - t_loaded:.0f} s",
        f"idle sides: while one was timed ({idle_wall:.1f} s in all) the others used {idle_cpu * 1e3:.0f} ms of CPU"
        f" ({idle_cpu / max(idle_wall, 1e-9):.2%}; most while {worst[0]} was timed:"
        f" {worst[1][1] / max(worst[1][0], 1e-9):.2%})",
        f"threads={args.threads}; memory read bandwidth {rng(bws, '.1f')} GB/s; llama-cpp-python"
        f" {lsys.get('version', '?')}: {lsys.get('system', '?').strip()}",
        "",
        "| form | MiB/token | limit tok/s | side | decode tok/s | of limit | ours / llama.cpp | prefill tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in forms:
        act, _ = active_bytes(files[f])
        for side in (f"llama-{f}", f"ours-{f}"):
            r = res[side]
            speeds = [n / t for t in r["decode"]]
            of = [s / (g * 1e9 / act) for s, g in zip(speeds, bws)]
            pf = rng([EB.PROMPT_LEN / t for t in r["prefill"]], ".0f") if r["prefill"] else "-"
            ratio = ""
            if side.startswith("ours"):
                xs = [lt / ot for ot, lt in zip(r["decode"], res[f"llama-{f}"]["decode"])]
                ratio = rng(xs, ".2f") + "x"
            head = f"| {f} | {act / 2**20:.1f} | {bw * 1e9 / act:.0f} |" if side.startswith("llama") else "| | | |"
            lines.append(f"{head} {side.split('-')[0]} | {rng(speeds, '.1f')} | {rng(of, '.2f')} | {ratio} | {pf} |")
    eng = {f: res[f"ours-{f}"]["info"].get("engine_active_bytes") for f in forms}
    lines.append("")
    lines.append("MiB/token: the file's tensors one decode step reads (experts at top-k of E, one embedding row); our"
                 " engine's own count of the weights it reads: "
                 + ", ".join(f"{f} {b / 2**20:.1f}" for f, b in eng.items() if b))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
