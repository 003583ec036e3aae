"""Built-in rule-based rewards: format and accuracy."""

from __future__ import annotations

import re
from typing import Any

from grpo.rewards import RewardFn, register

FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@register("format")
def format_reward(reward: float = 1.0, penalty: float = 0.0) -> RewardFn:
    """`reward` when the completion is exactly <think>...</think><answer>...</answer>, else `penalty`."""

    def score(completions: list[str], **_: Any) -> list[float | None]:
        return [reward if FORMAT_RE.match(c) else penalty for c in completions]

    return score


def extract_answer(text: str) -> str | None:
    """The content of the last <answer> tag, or None."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def answers_match(prediction: str, gold: str) -> bool:
    """Exact string, numeric, or math-verify equivalence (\\frac{1}{2} == 0.5)."""
    if prediction.strip() == gold.strip():
        return True
    try:
        return abs(float(prediction.replace(",", "")) - float(gold.replace(",", ""))) < 1e-9
    except ValueError:
        pass
    from math_verify import parse, verify

    # timeouts are signal based in math-verify and only work on the main thread; the runner's
    # per-call timeout bounds the check instead
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${prediction}$", parsing_timeout=None)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))


@register("accuracy")
def accuracy_reward(answer_field: str = "answer") -> RewardFn:
    """1 when the <answer> matches the row's gold answer, 0 otherwise; None without a gold answer."""

    def score(completions: list[str], **columns: Any) -> list[float | None]:
        golds = columns.get(answer_field) or [None] * len(completions)
        out: list[float | None] = []
        for completion, gold in zip(completions, golds, strict=True):
            if gold is None:
                out.append(None)
                continue
            predicted = extract_answer(completion)
            out.append(float(predicted is not None and answers_match(predicted, str(gold))))
        return out

    return score
