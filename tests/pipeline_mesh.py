"""Helpers for pipeline tests with real daemons on loopback: a serving node, stage nodes joined by invite,
requests over real HTTP (plain and SSE)."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conftest import meshd_cmd, meshd_env
from daemon_testlib import Node, start_node


def invite(state_dir: Path, uses: int = 4) -> str:
    return subprocess.run(
        meshd_cmd("invite", "--uses", str(uses), "--state-dir", str(state_dir)),
        env=meshd_env(),
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout.strip()


def stage(tmp: Path, name: str, token: str, spec: str = "tiny", *extra: str) -> Node:
    return start_node(tmp / name, "--stage", spec, "--join", token, *extra)


def pipeline_status(node: Node, model: str = "tiny") -> dict[str, Any]:
    return node.status()["services"]["pipeline"]["pipeline"]["models"][model]  # type: ignore[no-any-return]


def stage_status(node: Node) -> dict[str, Any]:
    return node.status()["services"]["pipeline"]["pipeline"]["stages"][0]  # type: ignore[no-any-return]


def wait_for(check: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - e.g. status not there yet
            last = e
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


def wait_plan(
    node: Node, layers: list[list[int] | None], timeout_s: float = 40.0, model: str = "tiny"
) -> dict[str, Any]:
    """Until the serving node's plan holds exactly these ranges, in order (this node first)."""

    def ok() -> Any:
        st = pipeline_status(node, model)
        plan = st.get("plan")
        return st if plan is not None and [s["layers"] for s in plan] == layers else None

    return wait_for(ok, timeout_s, f"plan {layers}")  # type: ignore[no-any-return]


def _conn(api: str) -> http.client.HTTPConnection:
    host, _, port = api.rpartition(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def post(api: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    c = _conn(api)
    try:
        c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def stream(api: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """SSE events of a streamed completion (``{"error": ...}`` events included); ends at [DONE] or EOF."""
    c = _conn(api)
    try:
        c.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            yield {"status": r.status, **json.loads(r.read())}
            return
        while True:
            line = r.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)
    finally:
        c.close()


def collect(events: list[dict[str, Any]], kind: str) -> tuple[str, list[Any]]:
    """(text, logprob entries) of streamed chunks (chat: delta content; completions: text)."""
    text, lps = "", []
    for ev in events:
        for ch in ev.get("choices", []):
            text += (ch.get("delta", {}).get("content") or "") if kind == "chat" else ch.get("text", "")
            lp = ch.get("logprobs")
            if lp:
                lps.extend(lp["content"] if kind == "chat" else lp["token_logprobs"])
    return text, lps


def whole(reply: dict[str, Any], kind: str) -> tuple[str, list[Any]]:
    ch = reply["choices"][0]
    if kind == "chat":
        return ch["message"]["content"], ch["logprobs"]["content"]
    return ch["text"], ch["logprobs"]["token_logprobs"]


SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 11}]


def same_as_ref(ref: Node, node: Node, requests: tuple[tuple[str, dict[str, Any]], ...]) -> int:
    """Every request of ``requests`` (path, body) greedy and seeded, streamed and not, gives ``node`` the text
    and logprobs ``ref`` gives; -> how many logprob entries were compared."""
    checked = 0
    for path, body in requests:
        kind = "chat" if "chat" in path else "completion"
        for sampling in SAMPLINGS:
            b = {**body, **sampling}
            code, want = post(ref.run["api"], path, b)
            assert code == 200, want
            code, got = post(node.run["api"], path, b)
            assert code == 200, got
            assert whole(got, kind) == whole(want, kind), (path, sampling)
            events = list(stream(node.run["api"], path, b))
            assert collect(events, kind) == whole(want, kind), (path, sampling)
            checked += len(whole(want, kind)[1])
    return checked
