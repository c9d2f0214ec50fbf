"""A userspace Ethernet hub for the chaos test: it joins the test's namespaces and can delay a host's frames.

The kernel here has no ``netem`` qdisc, so added delay is made in userspace: every host's veth peer lives
in the hub's namespace, this process reads each frame from one port (AF_PACKET) and writes it to every other
port, after the delay currently set for the port it came from or goes to. Loss and partitions are not made
here (the test uses iptables in the hosts' namespaces for those, as a real network fault would look).

Run inside the hub namespace: ``python chaos_hub.py CONTROL_SOCKET PORT...``. The control socket (a Unix
socket on the filesystem, reachable from the test's namespace) takes one JSON object per line,
``{"delay_ms": {"p2": 80}}`` (absent ports: no delay), answers ``{"ok": true}``, and ``{"stats": true}``
answers the counters. The hub stops when stdin closes (its parent, the test, went away).
"""

from __future__ import annotations

import heapq
import json
import os
import select
import socket
import sys
import threading
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
MAX_FRAME_BYTES = 65536  # offloads are off on every port, so frames stay near the 1500 B MTU
MAX_QUEUED_FRAMES = 20000  # delayed frames held at once; beyond that a frame is dropped (a full queue)


class Hub:
    def __init__(self, ports: list[str]) -> None:
        self.ports = ports
        self.socks: dict[str, socket.socket] = {}
        for p in ports:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((p, 0))
            s.setblocking(False)
            self.socks[p] = s
        self.by_fd = {s.fileno(): p for p, s in self.socks.items()}
        self.delay_s: dict[str, float] = {}
        self.queue: list[tuple[float, int, str, bytes]] = []
        self.seq = 0
        self.lock = threading.Lock()
        self.stats = {"frames": 0, "delayed": 0, "dropped_full": 0}

    def set_delays(self, delays_ms: dict[str, float]) -> None:
        with self.lock:
            self.delay_s = {p: float(ms) / 1000.0 for p, ms in delays_ms.items() if p in self.socks}

    def _send(self, port: str, frame: bytes) -> None:
        try:
            self.socks[port].send(frame)
        except OSError:
            pass  # a port whose host namespace is going away

    def _forward(self, src: str, frame: bytes, now: float) -> None:
        self.stats["frames"] += 1
        with self.lock:
            delays = dict(self.delay_s)
        for dst in self.ports:
            if dst == src:
                continue
            d = max(delays.get(src, 0.0), delays.get(dst, 0.0))
            if d <= 0.0:
                self._send(dst, frame)
            elif len(self.queue) >= MAX_QUEUED_FRAMES:
                self.stats["dropped_full"] += 1
            else:
                self.seq += 1
                self.stats["delayed"] += 1
                heapq.heappush(self.queue, (now + d, self.seq, dst, frame))

    def run(self) -> None:
        fds = list(self.by_fd)
        while True:
            now = time.monotonic()
            while self.queue and self.queue[0][0] <= now:
                _, _, dst, frame = heapq.heappop(self.queue)
                self._send(dst, frame)
            timeout = max(0.0, self.queue[0][0] - now) if self.queue else 0.05
            ready, _, _ = select.select(fds, [], [], min(timeout, 0.05))
            now = time.monotonic()
            for fd in ready:
                src = self.by_fd[fd]
                sock = self.socks[src]
                for _ in range(64):
                    try:
                        frame, addr = sock.recvfrom(MAX_FRAME_BYTES)
                    except BlockingIOError:
                        break
                    except OSError:
                        break
                    if addr[2] == PACKET_OUTGOING:
                        continue  # our own writes to this port
                    self._forward(src, frame, now)


def serve_control(hub: Hub, path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(4)
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rwb") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                    if "delay_ms" in msg:
                        hub.set_delays(dict(msg["delay_ms"]))
                    reply = {"ok": True, "stats": dict(hub.stats)}
                except (ValueError, TypeError) as e:
                    reply = {"ok": False, "error": str(e)}
                f.write(json.dumps(reply).encode() + b"\n")
                f.flush()


def main() -> None:
    control, ports = sys.argv[1], sys.argv[2:]
    hub = Hub(ports)
    threading.Thread(target=serve_control, args=(hub, control), daemon=True).start()
    threading.Thread(target=hub.run, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # returns when the test closes our stdin or dies


if __name__ == "__main__":
    main()
