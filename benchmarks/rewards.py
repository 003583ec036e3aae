"""The benchmarks' shared rewards (last integer right: 1.0; an <answer> tag: 0.5).

Standard library only: grpo runs user rewards in worker processes that import this file, so it
must not pull in torch (each worker would hold torch's memory, which the benchmarks' peak RSS of
the trainer process does not see).
"""

from __future__ import annotations

import re
from typing import Any

INT_RE = re.compile(r"-?\d+")


def last_integer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the last integer in the completion equals the gold answer."""
    found = [INT_RE.findall(c) for c in completions]
    return [float(bool(f) and f[-1] == str(a)) for f, a in zip(found, answer, strict=True)]


def answer_tag(completions: list[str], **_: Any) -> list[float]:
    """0.5 when the completion contains an <answer>...</answer> tag."""
    return [0.5 if re.search(r"<answer>.*?</answer>", c, re.DOTALL) else 0.0 for c in completions]
