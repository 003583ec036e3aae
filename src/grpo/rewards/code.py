"""Code reward: run the completion's program against the row's tests in the sandbox.

The row's ``tests`` column takes one of three forms:

- a test script (one string; HumanEval's ``check(candidate)`` plus ``check(entry_point)``),
  pass/fail as a whole;
- a list of test snippets (each usually one assert), which allows a fractional score;
- a list of ``{"input": ..., "output": ...}`` cases: the program reads stdin and must print the
  expected output (compared line by line after collapsing whitespace) and exit with status 0.

Function tests never run in the candidate's process: the candidate answers calls with plain
values, and a separate judge process runs the test code and reports the verdict
(``sandbox.judge_calls``). A program that crashes, exits or hangs before or while it is tested
passes nothing (no credit for defining the function and then failing). Scores are clamped to
[0, 1] in every mode.
"""

from __future__ import annotations

import re
from typing import Any

from grpo.rewards.registry import RewardError, RewardFn, register
from grpo.sandbox import Limits, judge_calls, run_limited

FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def extract_code(text: str) -> str:
    """The program in a completion: the last fenced python block, else the <answer> content,
    else the text without its <think> part."""
    fenced = FENCE_RE.findall(text)
    if fenced:
        return fenced[-1]
    answer = ANSWER_RE.findall(text)
    if answer:
        return answer[-1].strip("\n")
    return THINK_RE.sub("", text).strip("\n")


def with_prefix(program: str, prefix: str | None, entry_point: str | None) -> str:
    """HumanEval style rows give the signature in the prompt: a completion that only writes the
    body is appended to it; one that defines the function itself runs as it is."""
    if (
        not prefix
        or not entry_point
        or re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", program)
    ):
        return program
    return prefix + program


def normalise_output(text: str) -> list[str]:
    """Lines with runs of whitespace collapsed, without leading or trailing blank lines."""
    return [" ".join(line.split()) for line in text.strip().splitlines()]


def passed_io_cases(program: str, cases: list[dict[str, str]], limits: Limits) -> int:
    """Number of stdin/stdout cases the program gets right, one fresh sandbox per case."""
    passed = 0
    for case in cases:
        result = run_limited(program, str(case["input"]), limits)
        passed += (
            result.exit_code == 0
            and len(result.stdout.encode()) < limits.output_bytes
            and normalise_output(result.stdout) == normalise_output(str(case["output"]))
        )
    return passed


def passed_tests(
    program: str, tests: list[Any], limits: Limits, prefix: str | None, entry_point: str | None
) -> int:
    """Number of ``tests`` the program passes; the count comes from the judge (or, for stdin/
    stdout cases, from comparing what the program printed), never from the program."""
    if all(isinstance(t, dict) for t in tests):
        return passed_io_cases(program, tests, limits)
    verdict = judge_calls(program, tests, prefix=prefix, entry_point=entry_point, limits=limits)
    return len(verdict.passed)


SCORES = {
    "binary": lambda passed, total: float(passed == total),
    "fraction": lambda passed, total: passed / total,
}


def _as_tests(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return list(value)
    if isinstance(value, (list, tuple)) and all(
        isinstance(t, dict) and {"input", "output"} <= t.keys() for t in value
    ):
        return list(value)
    raise TypeError(
        "tests must be a string, a list of strings, or a list of {input, output} cases, "
        f"got {type(value).__name__}"
    )


# the smallest limits a correct program runs under (the candidate and the judge are two processes)
LIMIT_FLOORS = {"cpu_s": 1, "wall_s": 1, "memory_mb": 64, "file_mb": 1, "max_procs": 2}


@register("code", kind="accuracy")
def code_reward(
    tests_field: str = "tests",
    mode: str = "binary",
    prefix_field: str = "code_prefix",
    cpu_s: int = 5,
    wall_s: float = 10.0,
    memory_mb: int = 1024,
    file_mb: int = 16,
    max_procs: int = 32,
) -> RewardFn:
    """1/0 when all tests pass (``binary``) or the fraction passed (``fraction``); None for rows
    without tests."""
    if mode not in SCORES:
        raise RewardError(f"reward 'code': mode must be one of {', '.join(SCORES)}, got '{mode}'")
    given = {"cpu_s": cpu_s, "wall_s": wall_s, "memory_mb": memory_mb, "file_mb": file_mb}
    for name, value in {**given, "max_procs": max_procs}.items():
        if value < LIMIT_FLOORS[name]:
            raise RewardError(
                f"reward 'code': {name} must be at least {LIMIT_FLOORS[name]}, got {value} "
                "(below it no program, however right, runs to the end: every score would be 0)"
            )
    limits = Limits(
        cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, file_mb=file_mb, max_procs=max_procs
    )

    def score(completions: list[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        tests_column = columns.get(tests_field) or [None] * n
        prefixes = columns.get(prefix_field) or [None] * n
        entry_points = columns.get("entry_point") or [None] * n
        out: list[float | None] = []
        for text, tests, prefix, entry in zip(
            completions, tests_column, prefixes, entry_points, strict=True
        ):
            tests = [] if tests is None else _as_tests(tests)
            if not tests:
                out.append(None)
                continue
            program = with_prefix(extract_code(text), prefix, entry)
            passed = passed_tests(program, tests, limits, prefix, entry)
            out.append(min(1.0, max(0.0, SCORES[mode](passed, len(tests)))))
        return out

    score.columns = (tests_field,)  # type: ignore[attr-defined]  # RewardRunner checks them
    return score
