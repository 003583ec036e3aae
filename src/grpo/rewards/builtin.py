"""Format rewards: the strict seed format and a partial-credit tag count.

(The other built-ins live in their own modules: accuracy in ``accuracy``, countdown in
``countdown``, code in ``code``, length and repetition in ``length``, the reward model in
``reward_model``.)
"""

from __future__ import annotations

import re
from typing import Any

from grpo.rewards.registry import RewardError, RewardFn, register

SEED_TAGS = ("think", "answer")


def tag_names(tags: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Tag names as given (``think`` or ``<think>``), checked: at least one, word characters."""
    names = tuple(t.strip("<>/ ") for t in tags)
    if not names or any(not re.fullmatch(r"\w+", n) for n in names):
        raise RewardError(f"format tags must be names like 'think' or 'answer', got {list(tags)}")
    return names


def format_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    """The whole completion is the tags' sections in order, with only whitespace around them."""
    body = r"\s*".join(rf"<{t}>.*?</{t}>" for t in tags)
    return re.compile(rf"^\s*{body}\s*$", re.DOTALL)


@register("format", kind="format")
def format_reward(
    reward: float = 1.0, penalty: float = 0.0, tags: list[str] | tuple[str, ...] = SEED_TAGS
) -> RewardFn:
    """`reward` when the completion is exactly the tagged sections in order (by default
    <think>...</think><answer>...</answer>, the seed's format; `tags: [answer]` asks for the
    answer tag only), else `penalty` (the seed uses -1 or 0)."""
    pattern = format_pattern(tag_names(tags))

    def score(completions: list[str], **_: Any) -> list[float | None]:
        return [reward if pattern.match(c) else penalty for c in completions]

    return score


def tag_credit(text: str, tags: tuple[str, ...] = SEED_TAGS) -> float:
    """Share of the tags' opening and closing marks present exactly once and in order
    (<think></think><answer></answer> by default). A mark that appears more than once, or out of
    order, earns nothing."""
    marks = [m for t in tags for m in (f"<{t}>", f"</{t}>")]
    positions = [text.find(m) if text.count(m) == 1 else -1 for m in marks]
    earned, last = 0, -1
    for pos in positions:
        if pos > last:
            earned += 1
            last = pos
    return earned / len(marks)


@register("tag_count", kind="format")
def tag_count_reward(
    reward: float = 1.0, tags: list[str] | tuple[str, ...] = SEED_TAGS
) -> RewardFn:
    """Partial credit: `reward` x (share of the tags' marks present once and in order), so a model
    that never produces the full format still sees a gradient towards it."""
    names = tag_names(tags)

    def score(completions: list[str], **_: Any) -> list[float | None]:
        return [reward * tag_credit(c, names) for c in completions]

    return score
