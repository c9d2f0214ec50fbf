"""A member connecting to a node, timed: one side of bench/hostile.py.

Usage: ``PYTHONPATH=TREE python bench/hostile_probe.py CONFIG.json``. It imports ``transport`` from whatever
tree PYTHONPATH names (the code before or after a change), so it adds nothing to ``sys.path`` itself.
CONFIG: ``genesis`` and ``admin`` (to issue a fresh member certificate), ``addr`` [host, port], ``node_id``,
``count``, ``interval_s``, ``timeout_s``. Prints one JSON line: ``{"times": [...], "errors": [...]}``, a
failed connect counting as ``null`` in ``times``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from pathlib import Path

# bench/ holds a transport.py of its own (the transport benchmark): keep it from shadowing the package
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


async def probe(config: dict) -> dict:
    from transport.credentials import Genesis, MemberCert, MeshCredentials
    from transport.identity import NodeIdentity
    from transport.quic import MeshTransport, TransportConfig

    genesis = Genesis.decode(base64.b64decode(config["genesis"]))
    admin = NodeIdentity.from_private_bytes(bytes.fromhex(config["admin"]))
    addr = (config["addr"][0], int(config["addr"][1]))
    times: list[float | None] = []
    errors: list[str] = []
    for _ in range(int(config["count"])):
        ident = NodeIdentity.generate()
        creds = MeshCredentials(genesis, MemberCert.issue(admin, genesis, ident.public_key, int(time.time())))
        member = MeshTransport(ident, creds, TransportConfig())
        start = time.monotonic()
        try:
            async with asyncio.timeout(float(config.get("timeout_s", 5.0))):
                await member.connect(addr, expected_node_id=config["node_id"])
            times.append(time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - a failure is a data point
            times.append(None)
            errors.append(repr(e)[:200])
        finally:
            await member.close()
        await asyncio.sleep(float(config.get("interval_s", 0.3)))
    return {"times": times, "errors": errors}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-") or not Path(sys.argv[1]).is_file():
        print(__doc__.strip())  # a helper of bench/hostile.py: one CONFIG.json, no options
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(json.dumps(asyncio.run(probe(json.loads(Path(sys.argv[1]).read_text())))), flush=True)
