"""Write the acceptance tasks' data (checked in beside this script): deterministic, seed 0.

- ``radixkv_mc.jsonl``: 48 multiple-choice docs. Each is a village of six residents
  described in about 150 tokens (name, job, house colour, how many of which animal),
  then one question about one of them with four answers (the wrong ones from the same
  village in half the docs, from outside it in the rest); the four continuations share
  that context, as HellaSwag's and ARC's do, so a prefix cache serves three of every
  four prompts' contexts from the first.
- ``radixkv_gen.jsonl``: 16 generate_until docs: three worked examples, then a sequence
  of the same kind (numbers, weekdays, months, letters) whose next item the model writes.

    python benchmarks/acceptance/tasks/make_data.py   # rewrites the two files
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
NUM_MC = 48
NUM_GEN = 16

NAMES = (
    "Mara", "Tobin", "Ilse", "Pavel", "Rosa", "Emeka", "Linnea", "Oskar", "Yara", "Dario",
    "Freya", "Hugo", "Noor", "Silas", "Greta", "Anselm", "Wren", "Kofi", "Petra", "Milo",
)  # fmt: skip
JOBS = (
    "baker", "blacksmith", "weaver", "fisher", "potter", "miller", "carpenter", "teacher",
    "doctor", "shepherd", "brewer", "tailor",
)  # fmt: skip
COLORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey")
ANIMALS = ("goats", "hens", "ducks", "cats", "dogs", "sheep", "geese", "rabbits", "pigs")
VILLAGES = ("Eastbrook", "Harrow End", "Millford", "Stonegate", "Willowmere", "Ashby")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
NUM_RESIDENTS = 6
NUM_CHOICES = 4


def mc_doc(rng: random.Random, k: int) -> dict[str, object]:
    """One multiple-choice doc: ``context``, ``question``, four ``choices``, ``label``.
    Half the docs (``k % 8 < 4``) take the three wrong answers from the other residents
    (the model must read the right line); the rest from outside the village (it need
    only notice which answer the context mentions)."""
    names = rng.sample(NAMES, NUM_RESIDENTS)
    jobs = rng.sample(JOBS, NUM_RESIDENTS)
    colors = rng.sample(COLORS, NUM_RESIDENTS)
    animals = rng.sample(ANIMALS, NUM_RESIDENTS)
    counts = [rng.randint(2, 9) for _ in range(NUM_RESIDENTS)]
    village = VILLAGES[k % len(VILLAGES)]
    lines = [f"In the village of {village}, six neighbours live along the river road."]
    for name, job, color, count, animal in zip(names, jobs, colors, counts, animals):
        lines.append(f"{name}, the {job}, lives in the {color} house and keeps {count} {animal}.")
    lines.append("Every evening they meet at the well to trade news.")
    who = rng.randrange(NUM_RESIDENTS)
    kind = k % 4
    if kind == 0:
        question, column, pool = f"Who lives in the {colors[who]} house?", names, NAMES
    elif kind == 1:
        question, column, pool = f"What does {names[who]} keep?", animals, ANIMALS
    elif kind == 2:
        question, column, pool = f"What is {names[who]}'s job?", jobs, JOBS
    else:
        question, column, pool = f"What colour is {names[who]}'s house?", colors, COLORS
    if k % 8 < 4:
        others = rng.sample([column[i] for i in range(NUM_RESIDENTS) if i != who], NUM_CHOICES - 1)
    else:
        others = rng.sample([v for v in pool if v not in column], NUM_CHOICES - 1)
    choices = [column[who], *others]
    rng.shuffle(choices)
    if kind == 2:
        choices = [f"the {job}" for job in choices]
    return {
        "id": k,
        "context": "\n".join(lines),
        "question": question,
        "choices": choices,
        "label": choices.index(f"the {jobs[who]}" if kind == 2 else column[who]),
    }


def sequence(rng: random.Random, kind: int) -> list[str]:
    """Five consecutive items of a sequence of ``kind``: 0 numbers, 1 weekdays, 2 months,
    3 letters."""
    if kind == 0:
        start, step = rng.randint(1, 60), rng.choice((1, 2, 5, 10))
        return [str(start + i * step) for i in range(5)]
    items = (WEEKDAYS, MONTHS, LETTERS)[kind - 1]
    start = rng.randrange(len(items))
    return [items[(start + i) % len(items)] for i in range(5)]


def gen_doc(rng: random.Random, k: int) -> dict[str, object]:
    """One generate_until doc: ``prompt`` (three worked examples of the same kind, then the
    question) and ``answer``, the sequence's next item."""
    kind = k % 4
    parts = ["Write the next item of each sequence."]
    examples: list[list[str]] = []
    while len(examples) < 4:  # three examples and the question, all different
        s = sequence(rng, kind)
        if s not in examples:
            examples.append(s)
    for s in examples[:3]:
        parts.append(f"Sequence: {', '.join(s[:4])}\nNext: {s[4]}")
    s = examples[3]
    parts.append(f"Sequence: {', '.join(s[:4])}\nNext:")
    return {"id": k, "prompt": "\n\n".join(parts), "answer": s[4]}


def write_jsonl(path: Path, docs: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")


def main() -> None:
    rng = random.Random(SEED)
    write_jsonl(HERE / "radixkv_mc.jsonl", [mc_doc(rng, k) for k in range(NUM_MC)])
    write_jsonl(HERE / "radixkv_gen.jsonl", [gen_doc(rng, k) for k in range(NUM_GEN)])


if __name__ == "__main__":
    main()
