"""Load and observation driver for the chaos test; runs inside one host's namespace, on its node's API.

``python chaos_driver.py API_PORT OUT_JSONL DURATION_S [--load N]``: polls ``/v1/models`` every 0.2 s and,
with ``--load N``, keeps N requests in flight (chat and completions, streaming and not, greedy, several
prompts). First it records a reference text for every (model, prompt) while the mesh is quiet. Every
observation is one JSON line with CLOCK_MONOTONIC times (shared by every namespace of the machine), so the
test can hold each one against the faults it injected. The driver judges nothing; the test does.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import sys
import threading
import time
from typing import Any

PROMPTS = ["hello mesh", "tell me about rivers", "count: one two", "quick brown fox", "pipes and lanes"]
MAX_TOKENS = 8
REQUEST_LIMIT_S = 30.0  # a request not finished by then is a hang (the invariant's limit)
READY_LIMIT_S = 30.0  # how long the references wait for the client to list every model


class Out:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def write(self, **rec: Any) -> None:
        with self.lock:
            self.f.write(json.dumps(rec) + "\n")


def _body(model: str, prompt: str, chat: bool, stream: bool) -> bytes:
    req: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if chat:
        req["messages"] = [{"role": "user", "content": prompt}]
    else:
        req["prompt"] = prompt
    return json.dumps(req).encode()


def request(port: int, model: str, prompt: str, chat: bool, stream: bool) -> dict[str, Any]:
    """One request; returns status, text, how it ended and the serving node. Never raises."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_LIMIT_S)
    res: dict[str, Any] = {"status": None, "text": "", "end": None, "node": None}
    try:
        conn.request("POST", path, _body(model, prompt, chat, stream), {"content-type": "application/json"})
        r = conn.getresponse()
        res["status"] = r.status
        res["node"] = r.getheader("x-meshd-node")
        if r.status != 200:
            data = r.read()
            try:
                res["end"] = "error_json" if "error" in json.loads(data) else "bad_error_body"
            except ValueError:
                res["end"] = "bad_error_body"
            return res
        if not stream:
            obj = json.loads(r.read())
            ch = obj["choices"][0]
            res["text"] = ch["message"]["content"] if chat else ch["text"]
            res["end"] = "complete"
            return res
        parts: list[str] = []
        while True:
            line = r.readline()
            if not line:
                # the connection closed: fine after an error event, truncated after neither it nor [DONE]
                res["end"] = res["end"] or "truncated"
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                res["end"] = res["end"] or "complete"
                break
            obj = json.loads(data)
            if "error" in obj:
                res["end"] = "error_event"
                continue
            for ch in obj.get("choices", []):
                parts.append((ch.get("delta") or {}).get("content") or "" if chat else ch.get("text") or "")
        res["text"] = "".join(parts)
    except TimeoutError:
        res["end"] = "timeout"
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        res["end"] = f"exception:{type(e).__name__}"
    finally:
        conn.close()
    return res


def models(port: int) -> list[str] | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        if r.status != 200:
            return None
        return sorted(m["id"] for m in json.loads(r.read())["data"])
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return None
    finally:
        conn.close()


def main() -> None:
    port, out_path, duration = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    load = int(sys.argv[sys.argv.index("--load") + 1]) if "--load" in sys.argv else 0
    out = Out(out_path)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())  # the test's "faults are over": finish in-flight work
    stop_at = time.monotonic() + duration

    if load:
        # the references need a quiet, complete mesh: the test waits for membership to agree, but a client's
        # route to a model arrives with that model's advertisement, which can trail membership under load
        listed_by = time.monotonic() + READY_LIMIT_S
        while (models(port) or []) != ["solo", "tiny"] and time.monotonic() < listed_by:
            time.sleep(0.2)
        for model in ("tiny", "solo"):
            for prompt in PROMPTS:
                r = request(port, model, prompt, chat=False, stream=False)
                out.write(kind="reference", model=model, prompt=prompt, chat=False, **r)
                r = request(port, model, prompt, chat=True, stream=False)
                out.write(kind="reference", model=model, prompt=prompt, chat=True, **r)
    out.write(kind="started", t=time.monotonic())

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at and not stop.is_set():
            model = rng.choice(["tiny", "tiny", "solo"])
            prompt, chat, stream = rng.choice(PROMPTS), rng.random() < 0.5, rng.random() < 0.5
            t0 = time.monotonic()
            out.write(kind="begin", t0=t0, worker=seed)
            r = request(port, model, prompt, chat, stream)
            out.write(kind="request", t0=t0, t1=time.monotonic(), model=model, prompt=prompt, chat=chat,
                      stream=stream, worker=seed, **r)
            if r["status"] != 200:
                time.sleep(0.1)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(load)]
    for t in threads:
        t.start()
    while time.monotonic() < stop_at and not stop.is_set():
        t0 = time.monotonic()
        out.write(kind="models", t=t0, models=models(port))
        stop.wait(max(0.0, 0.2 - (time.monotonic() - t0)))
    for t in threads:
        t.join(REQUEST_LIMIT_S + 5)
    out.write(kind="done", t=time.monotonic())


if __name__ == "__main__":
    main()
