"""The README tells the truth: its code runs as written, and its lists match the repository.

- Every ```python block of README.md is executed as written, with the names it leaves to
  the reader (``requests``, ``max_new``, ``run_model``) supplied, once per prompt type it
  advertises (a list, a numpy array, a torch tensor). A stand-in model checks what the
  loop hands it (the cached prefix a brute-force oracle expects, a table long enough for
  the reply) and, after the loop, the cache must hold exactly the full blocks of every
  request's prompt + reply[:-1] (the tokens with K/V): a loop that does not tell the
  manager what ran fails it.
- The install paragraph names every extra of pyproject.toml and every package each one
  (and the core) depends on.
- Every row of the "Measured" table is dated and names a command that docs/benchmarks.md
  lists under "README rows", with the same date.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
BLOCK_SIZE = 16  # the README's allocator
SYSTEM = list(range(1000, 1040))  # a shared system prompt: 2 full blocks and 8 tokens


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def as_list(tokens: object) -> list[int]:
    """Token ids of a list, numpy array or CPU tensor as a list of Python ints."""
    return [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]


def floor_block(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def numpy_int64(tokens: list[int]) -> object:
    return np.array(tokens, dtype=np.int64)


def numpy_int32(tokens: list[int]) -> object:
    return np.array(tokens, dtype=np.int32)


def torch_tensor(tokens: list[int]) -> object:
    torch = pytest.importorskip("torch")
    return torch.tensor(tokens)


PROMPT_TYPES: dict[str, Callable[[list[int]], object]] = {
    "list": list,
    "numpy-int64": numpy_int64,
    "numpy-int32": numpy_int32,
    "torch": torch_tensor,
}


@dataclass
class Loop:
    """The reader's side of the README loop: the requests, and a model that checks its inputs.

    ``offered`` holds, per finished request, the tokens the loop should have offered to
    the cache (prompt + reply[:-1]); ``cached`` what ``match_prefix`` reported for each.
    """

    convert: Callable[[list[int]], object]
    max_new: int
    offered: list[list[int]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    replies: list[list[int]] = field(default_factory=list)

    def requests(self) -> Iterator[object]:
        """Three users' first turns, then each one's second turn (first prompt + reply +
        a new message), built lazily from the replies, in the prompt type under test."""
        first = []
        for user in range(3):
            prompt = SYSTEM + [2000 + 100 * user + i for i in range(10 + 7 * user)]
            first.append(prompt)
            yield self.convert(prompt)
        for user in range(3):
            yield self.convert(first[user] + self.replies[user] + [3000 + user, 3001 + user])

    def expected_cached(self, prompt: list[int]) -> int:
        """What an unbounded block-aligned cache holds of ``prompt[:-1]`` (brute force)."""
        best = 0
        for seq in self.offered:
            full = seq[: floor_block(len(seq))]
            best = max(best, floor_block(common_prefix(prompt[:-1], full)))
        return best

    def run_model(self, prompt: object, cached: int, table: list[int]) -> list[int]:
        """Check what the loop hands the model; reply with ``max_new`` fresh token ids."""
        tokens = as_list(prompt)
        assert cached == self.expected_cached(tokens), "match_prefix found the wrong prefix"
        assert len(table) * BLOCK_SIZE >= len(tokens) + self.max_new, "table too short"
        reply = [5000 + 100 * len(self.replies) + i for i in range(self.max_new)]
        self.cached.append(cached)
        self.replies.append(reply)
        self.offered.append(tokens + reply[:-1])
        return reply


def run_block(block: str, loop: Loop) -> dict:
    """Execute one README block as written with the reader's names; return its namespace."""
    namespace = {"requests": loop.requests(), "max_new": loop.max_new, "run_model": loop.run_model}
    exec(compile(block, str(README), "exec"), namespace)
    return namespace


def check_loop(block: str, convert: Callable[[list[int]], object], max_new: int) -> None:
    """Run ``block`` and assert the cache holds exactly what every request computed."""
    loop = Loop(convert, max_new)
    manager = run_block(block, loop)["manager"]
    assert len(loop.replies) == 6, "every request ran"
    assert min(loop.cached[3:]) >= 32, "second turns reuse their first turn's blocks"
    manager.check()
    assert manager.num_requests == 0
    for seq in loop.offered:
        assert manager.cache.peek(seq) == floor_block(len(seq)), "the cache lacks computed blocks"


def readme_loop_block() -> str:
    blocks = [b for b in python_blocks(README.read_text()) if "KVCacheManager(" in b]
    assert len(blocks) == 1, "README has one KVCacheManager loop"
    return blocks[0]


def test_readme_has_python_blocks() -> None:
    assert python_blocks(README.read_text()), "README.md has no ```python block"


@pytest.mark.parametrize("max_new", [2, 20])
@pytest.mark.parametrize("prompt_type", list(PROMPT_TYPES))
def test_readme_blocks_run_as_written(prompt_type: str, max_new: int) -> None:
    """Every python block runs as written; the loop caches the right tokens for each type."""
    convert = PROMPT_TYPES[prompt_type]
    for block in python_blocks(README.read_text()):
        if "KVCacheManager(" in block:
            check_loop(block, convert, max_new)
        else:
            run_block(block, Loop(convert, max_new))


@pytest.mark.parametrize("max_new", [2, 20])
def test_the_check_catches_a_loop_that_does_not_say_what_ran(max_new: int) -> None:
    """Without the append, the manager knows only the matched prefix has K/V: the checks
    above must fail (the next turn finds less cached than the oracle expects)."""
    append = r"\n *manager\.append_output_tokens\(rid, output\).*"
    block, n = re.subn(append, "", readme_loop_block())
    assert n == 1, "README's append line changed: update this test's mutation"
    with pytest.raises(AssertionError, match="wrong prefix|lacks computed blocks"):
        check_loop(block, list, max_new)


def package_name(requirement: str) -> str:
    """A requirement's distribution name: ``ray[serve]==2.60.*`` -> ``ray``."""
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]


def install_paragraph() -> str:
    text = README.read_text()
    start = text.index("Installed by hand")
    return text[start : text.index("\n## ", start)]


def test_install_paragraph_names_every_extra_and_dependency() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    paragraph = install_paragraph()
    for requirement in project["dependencies"]:
        assert package_name(requirement) in paragraph, f"core dependency {requirement!r}"
    for extra, requirements in project["optional-dependencies"].items():
        assert f"`radixkv[{extra}]`" in paragraph, f"extra {extra!r}"
        for requirement in requirements:
            name = package_name(requirement)
            if name != "radixkv":  # `all` names the other extras
                assert name in paragraph, f"{requirement!r} of extra {extra!r}"


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``heading`` (header and rule skipped)."""
    start = text.index(heading)
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_measured_rows_are_dated_and_name_a_listed_command() -> None:
    listed = {
        row[0].strip("`"): row[1] for row in table_rows(BENCHMARKS.read_text(), "## README rows")
    }
    rows = table_rows(README.read_text(), "## Measured")
    assert rows
    for row in rows:
        run = row[-1]
        m = re.match(
            r"(\d{4}-\d{2}-\d{2}), .*\[`([a-z0-9-]+)`\]\(docs/benchmarks\.md#readme-rows\)$", run
        )
        assert m, f"row {row[0]!r}: last cell {run!r} is not 'date, machine, [`label`](...)'"
        date, label = m.groups()
        assert label in listed, f"row {row[0]!r}: {label!r} is not under README rows"
        assert listed[label] == date, f"row {row[0]!r}: {date} here, {listed[label]} there"
