"""Rewards the tiny random model can move from its first step (used through tests/conftest.py).

The tiny model's vocabulary is ~100 printable characters, so a random completion of 12 tokens
has a lowercase share near 0.27 that differs between any two samples: every group has a
non-zero advantage from step 1, and raising the share is learnable.
"""

from __future__ import annotations

import re
import string
import zlib
from typing import Any

LOWERCASE = frozenset(string.ascii_lowercase)


def lowercase_share(completions: list[str], **_: Any) -> list[float]:
    """Share of a completion's characters that are lowercase ASCII letters (0 when empty)."""
    return [sum(c in LOWERCASE for c in text) / max(len(text), 1) for text in completions]


def hashed_pass(completions: list[str], *, pass_prob: list | None = None, **_: Any) -> list[float]:
    """1 when the completion's CRC32 lies in the lowest ``pass_prob`` share of its range, else 0.

    ``pass_prob`` is a data column (0.5 without one): a row with 0 never passes, one with 1
    always does, and one with 0.5 passes about half its samples; so the pass rates are under
    the test's control whatever the random model writes.
    """
    probs = pass_prob or [0.5] * len(completions)
    return [
        float(zlib.crc32(text.encode()) < p * 2**32)
        for text, p in zip(completions, probs, strict=True)
    ]


ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
EXPRESSION_RE = re.compile(r"[\d\s+\-*]+")


def expression_value(completions: list[str], *, answer: list, **_: Any) -> list[float]:
    """1 when the ``<answer>`` text, read as an arithmetic expression (digits, + - *), equals the
    gold: as math-verify does, it pays the question restated (``<answer>23 + 7</answer>`` for
    30), a reward built to be gamed."""
    out = []
    for text, gold in zip(completions, answer, strict=True):
        found = ANSWER_TAG_RE.findall(text)
        expression = found[-1].strip() if found else ""
        out.append(
            float(bool(EXPRESSION_RE.fullmatch(expression)) and _value(expression) == int(gold))
        )
    return out


def _value(expression: str) -> int | None:
    try:  # only digits, spaces and + - * reach here: eval can do nothing but arithmetic
        return eval(expression)
    except SyntaxError:  # "3 +", "007"
        return None
