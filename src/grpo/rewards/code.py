"""Code reward: run the completion's program against the row's tests in the sandbox.

The row's ``tests`` column is either one test script (pass/fail as a whole; HumanEval's
``check(candidate)``), or a list of test snippets (each an assert), which allows a fractional
reward. A run passes a test only when the harness prints its verdict line, marked with a nonce
the program never sees as an argument, file or environment variable (it arrives on stdin and is
read before the program starts): a program that exits early or crashes gets 0, never a pass.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from grpo.rewards import RewardError, RewardFn, register
from grpo.rewards.sandbox import Limits, run_limited

FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)

HARNESS = """\
import json as _json, os as _os, sys as _sys
_nonce = _sys.stdin.readline().strip()
_verdict_fd = _os.dup(1)
_program, _tests = _json.loads({payload!r})
_passed = []
_ns = {{"__name__": "solution"}}
try:
    exec(compile(_program, "solution.py", "exec"), _ns)
except BaseException:
    _tests = []
for _i, _test in enumerate(_tests):
    try:
        exec(compile(_test, f"test_{{_i}}.py", "exec"), _ns)
        _passed.append(_i)
    except BaseException:
        pass
_os.write(_verdict_fd, (_nonce + " " + _json.dumps(_passed) + "\\n").encode())
"""


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


def passed_tests(program: str, tests: list[str], limits: Limits) -> int:
    """Number of ``tests`` that pass after ``program`` ran, in one sandboxed process."""
    nonce = secrets.token_hex(16)
    source = HARNESS.format(payload=json.dumps([program, tests]))
    result = run_limited(source, nonce + "\n", limits)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce + " "):
            return len(json.loads(line[len(nonce) + 1 :]))
    return 0


SCORES = {
    "binary": lambda passed, total: float(passed == total),
    "fraction": lambda passed, total: passed / total,
}


def _as_tests(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return list(value)
    raise TypeError(f"tests must be a string or a list of strings, got {type(value).__name__}")


@register("code")
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
            out.append(SCORES[mode](passed_tests(program, tests, limits), len(tests)))
        return out

    return score
