"""Command-line entry point: parses SPEC's commands and dispatches each to ``meshd.commands.<name>``.

Each command module exposes ``run(args: argparse.Namespace) -> int``. Errors derived from
``meshd.errors.MeshdError`` become one line on stderr with their exit code; argparse usage errors exit 2.
A closed standard output (``meshd generate ... | head``) ends the command quietly with exit 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from meshd import __version__
from meshd.errors import EXIT_USAGE, MeshdError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One readable line, exit 2 (SPEC), instead of argparse's usage dump.
        sys.stderr.write(f"meshd: {message}\n")
        raise SystemExit(EXIT_USAGE)


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="DIR", help="state directory (default: $MESHD_STATE_DIR, "
                   "$STATE_DIRECTORY, ~/.local/state/meshd)")


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=["json", "pretty"], help="log format (default: pretty on a "
                   "terminal, json otherwise)")
    p.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning, error (default: info)")


def _add_networking(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file with the same keys as the long flags; flags override it "
                   "(default: none)")
    _add_state_dir(p)
    p.add_argument("--listen", metavar="HOST:PORT", help="QUIC (UDP) address (default 0.0.0.0:9336)")
    p.add_argument("--api", metavar="HOST:PORT", help="OpenAI API address (default 127.0.0.1:9337)")
    p.add_argument("--lane-listen", metavar="HOST:PORT|off",
                   help="data lane (TLS over TCP) address for expert/pipeline traffic, or off "
                        "(default: TCP on the --listen host and port)")
    p.add_argument("--relay", choices=["on", "off"],
                   help="forward traffic between members that have no direct path (default on)")
    join = p.add_mutually_exclusive_group()
    join.add_argument("--join", metavar="TOKEN", help="invite token to join a mesh, or - to read it from "
                      "standard input (a token here is visible in ps) (also $MESHD_JOIN; default: none)")
    join.add_argument("--join-file", metavar="FILE", help="file holding an invite token, not readable by "
                      "group or others (also $MESHD_JOIN_FILE; default: none)")
    p.add_argument("--mesh-name", metavar="NAME", help="name of the mesh this node creates if it has none "
                   "(default: none)")
    p.add_argument("--no-mdns", action="store_true", default=None, help="do not announce or browse mDNS (default: mDNS on)")
    p.add_argument("--api-key-file", metavar="FILE", help="file with API bearer keys, one per line, not readable "
                   "by group or others (default: none: no key, loopback API only)")
    _add_logging(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="meshd", description="A private mesh of machines serving models.")
    parser.add_argument("--version", action="version", version=f"meshd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("serve", help="run a node that serves models and/or expert shards")
    _add_networking(p)
    p.add_argument("--model", action="append", metavar="SPEC", help="model to serve: PATH (checkpoint "
                   "directory or .gguf), tiny, or openai:URL, optionally NAME=SPEC (repeatable; default: none)")
    p.add_argument("--experts", action="append", metavar="SPEC", help="expert shards to hold for other "
                   "nodes: PATH[@LAYERS/EXPERTS], PATH a checkpoint directory, .gguf or tiny (repeatable; default: "
                   "none)")
    p.add_argument("--remote-experts", choices=["off", "on", "prefer"], help="hand routed experts to "
                   "workers (default off)")
    # Parsed and checked (positive, message <= layer) in meshd.config with the config file's values.
    p.add_argument("--experts-connect-timeout", metavar="SECONDS", help="expert workers: connect and hello "
                   "timeout (default 5)")
    p.add_argument("--experts-message-timeout", metavar="SECONDS", help="expert workers: timeout of each "
                   "request until its reply (default 10)")
    p.add_argument("--experts-layer-timeout", metavar="SECONDS", help="expert workers: timeout of each "
                   "layer, retries included (default 30)")
    p.add_argument("--experts-poll", metavar="SECONDS", help="expert workers: poll this long for a reply, "
                   "or a worker for the next request, instead of sleeping, where a core is free (0 to 0.1, "
                   "default 0.002; 0 turns it off)")
    p.add_argument("--stage", action="append", metavar="PATH[@FIRST-LAST]", help="hold layers of a "
                   "checkpoint (directory, .gguf or tiny) as a pipeline stage: any range the planner assigns, or "
                   "exactly FIRST-LAST "
                   "(repeatable; default none)")
    p.add_argument("--pipeline", choices=["off", "on", "prefer"], help="split each served model's layers "
                   "over stage nodes with the same checkpoint: on requires a plan that fits (else 503), "
                   "prefer falls back to local (default off)")
    p.add_argument("--pipeline-memory", metavar="MB", help="memory this node offers for pipeline layers, "
                   "as a stage and as the serving node (default 0: the machine's available memory)")

    p = sub.add_parser("client", help="run a headless node: joins, serves nothing, exposes the API")
    _add_networking(p)

    p = sub.add_parser("invite", help="ask the running daemon for an invite token")
    _add_state_dir(p)
    p.add_argument("--ttl", metavar="DURATION", default="24h", help="validity, e.g. 30m, 24h, 7d "
                   "(default 24h)")
    p.add_argument("--uses", metavar="N", type=int, default=1, help="how many nodes may join with it "
                   "(default 1)")

    p = sub.add_parser("join", help="make the running daemon join a mesh")
    _add_state_dir(p)
    p.add_argument("token", metavar="TOKEN", help="invite token (meshd1...) printed by `meshd invite` on the "
                   "admin node, or - to read it from standard input, which keeps it out of ps (required)")

    p = sub.add_parser("status", help="show this node, its mesh, peers and models")
    _add_state_dir(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (default: text)")

    p = sub.add_parser("doctor", help="check what usually breaks a mesh and say how to fix it (exit 1 on a failure)")
    _add_state_dir(p)
    p.add_argument("--json", action="store_true", help="print the checks as one JSON list (default: text)")

    p = sub.add_parser("ban", help="revoke a member mesh-wide (needs the mesh admin key)")
    _add_state_dir(p)
    p.add_argument("node_id", metavar="NODE_ID", help="id of the member to ban, as `meshd status` shows it "
                   "(required)")

    p = sub.add_parser("generate", help="generate text with a model in this process")
    p.add_argument("--model", required=True, metavar="SPEC",
                   help="model to run: PATH (checkpoint directory or .gguf) or tiny (required)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text, used as is (required)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most "
                   "(default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is "
                   "greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens; "
                   "0 is all (default 0)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence "
                   "(default: stop there)")
    p.add_argument("--json", action="store_true", help="print one JSON object: model, prompt_tokens, tokens, "
                   "text, logprobs, finish_reason, timings (default: the text)")
    _add_state_dir(p)

    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND", parser_class=_Parser)
    msub.required = True
    c = msub.add_parser("create-tiny", help="write the synthetic tiny MoE checkpoint to DIR")
    c.add_argument("dir", metavar="DIR", help="directory to write the checkpoint into (required)")
    c.add_argument("--arch", choices=["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3"], default="qwen3_moe",
                   help="architecture (default qwen3_moe)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")

    p = sub.add_parser("identity", help="print this node's id")
    _add_state_dir(p)
    return parser


_COMMAND_MODULES = {
    "serve": "meshd.commands.serve",
    "client": "meshd.commands.serve",
    "invite": "meshd.commands.invite",
    "join": "meshd.commands.join",
    "status": "meshd.commands.status",
    "doctor": "meshd.commands.doctor",
    "ban": "meshd.commands.ban",
    "generate": "meshd.commands.generate",
    "model": "meshd.commands.model",
    "identity": "meshd.commands.identity",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        module = importlib.import_module(_COMMAND_MODULES[args.command])
        return int(module.run(args))
    except MeshdError as e:
        sys.stderr.write(f"meshd: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `meshd generate ... | head -c 100`: the reader has what it wanted
        # Point stdout at /dev/null so the interpreter's final flush cannot raise (and print) again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
