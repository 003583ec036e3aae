"""Format rewards: the strict seed format and a partial-credit tag count.

(The other built-ins live in their own modules: accuracy in ``accuracy``, countdown in
``countdown``, code in ``code``, length and repetition in ``length``, the reward model in
``reward_model``.)
"""

from __future__ import annotations

import re
from typing import Any

from grpo.rewards import RewardFn, register

FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@register("format")
def format_reward(reward: float = 1.0, penalty: float = 0.0) -> RewardFn:
    """`reward` when the completion is exactly <think>...</think><answer>...</answer>, else
    `penalty` (the seed's strict format; -1 and 0 are common choices for the penalty)."""

    def score(completions: list[str], **_: Any) -> list[float | None]:
        return [reward if FORMAT_RE.match(c) else penalty for c in completions]

    return score


def tag_credit(text: str) -> float:
    """Share of the four tags present exactly once, in order <think></think><answer></answer>.

    A tag that appears more than once, or out of order, earns nothing.
    """
    positions = [text.find(tag) if text.count(tag) == 1 else -1 for tag in TAGS]
    earned, last = 0, -1
    for pos in positions:
        if pos > last:
            earned += 1
            last = pos
    return earned / len(TAGS)


@register("tag_count")
def tag_count_reward(reward: float = 1.0) -> RewardFn:
    """Partial credit: `reward` x (share of the four tags present once and in order), so a model
    that never produces the full format still sees a gradient towards it."""

    def score(completions: list[str], **_: Any) -> list[float | None]:
        return [reward * tag_credit(c) for c in completions]

    return score
