"""Writes the parity run's task data (``eval/tasks/*.jsonl``) from a fixed seed.

No dataset hub is reachable from where PDD is tested, so the tasks are generated: a
loglikelihood multiple-choice task (two-number sums, four choices) and a generate-until
task (continue an arithmetic sequence). Run from the repository root:
``.venv/bin/python eval/make_tasks.py`` — the files it writes are checked in.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "tasks"


def arith_mc(rng: random.Random, n: int) -> list[dict]:
    docs = []
    for _ in range(n):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        right = a + b
        wrong = rng.sample(
            sorted({right - 10, right - 1, right + 1, right + 10, right + 2} - {right}), 3
        )
        choices = [str(right), *map(str, wrong)]
        rng.shuffle(choices)
        docs.append({"a": a, "b": b, "choices": choices, "answer": choices.index(str(right))})
    return docs


def sequence_gen(rng: random.Random, n: int) -> list[dict]:
    docs = []
    for _ in range(n):
        start, step = rng.randint(1, 30), rng.randint(1, 9)
        terms = [start + i * step for i in range(5)]
        docs.append({"prompt": ", ".join(map(str, terms[:4])) + ",", "answer": str(terms[4])})
    return docs


def main() -> None:
    rng = random.Random(21)
    for name, docs in (
        ("pdd_arith_mc", arith_mc(rng, 150)),
        ("pdd_sequence_gen", sequence_gen(rng, 100)),
    ):
        path = HERE / f"{name}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        print(f"{path}: {len(docs)} items")


if __name__ == "__main__":
    main()
