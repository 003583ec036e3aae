"""Built-in tasks: seeded generators or offline data files, each with a prompt template, an
answer field and default rewards. ``grpo tasks`` lists them."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REASONING_SYSTEM = (
    "You are a helpful assistant. Think step by step inside <think> </think>, then give only the "
    "final answer inside <answer> </answer>. Example: <think>2 + 3 = 5</think><answer>5</answer>"
)


@dataclass(frozen=True)
class Task:
    """rows(split, seed, **args) -> list of {prompt, answer, ...}."""

    name: str
    description: str
    rows: Callable[..., list[dict[str, Any]]]
    system_prompt: str | None = REASONING_SYSTEM
    default_rewards: list[str] = field(default_factory=lambda: ["format", "accuracy"])
    splits: tuple[str, ...] = ("train", "test")


SPLIT_SALT = {"train": 0, "test": 1_000_003, "validation": 2_000_003}


def _split_rng(split: str, seed: int) -> random.Random:
    if split not in SPLIT_SALT:
        raise ValueError(f"split must be one of {', '.join(SPLIT_SALT)}, got '{split}'")
    return random.Random(seed * 7919 + SPLIT_SALT[split])


def arithmetic_rows(
    split: str = "train",
    seed: int = 0,
    size: int = 1000,
    min_value: int = 1,
    max_value: int = 99,
    operations: str = "+-",
) -> list[dict[str, Any]]:
    """Seeded "What is a + b?" problems; train and test draw from disjoint random streams and
    test excludes any (a, op, b) seen in train."""
    def draw(rng: random.Random, n: int, exclude: set) -> list[tuple[int, str, int]]:
        seen, out = set(exclude), []
        while len(out) < n:
            item = (rng.randint(min_value, max_value), rng.choice(operations), rng.randint(min_value, max_value))
            if item not in seen:
                seen.add(item)
                out.append(item)
        return out

    train = draw(_split_rng("train", seed), size, set())
    items = train if split == "train" else draw(_split_rng(split, seed), size, set(train))
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    return [
        {"prompt": f"What is {a} {op} {b}?", "answer": str(ops[op](a, b))} for a, op, b in items
    ]


TASKS: dict[str, Task] = {
    "arithmetic": Task(
        name="arithmetic",
        description="seeded two-number arithmetic ('What is 12 + 7?'); answer is the integer",
        rows=arithmetic_rows,
    ),
}
