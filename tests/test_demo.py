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
