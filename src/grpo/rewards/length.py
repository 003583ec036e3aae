"""Length and repetition shaping: DAPO's soft overlong punishment, a token budget, and an
n-gram repetition penalty. Lengths are completion token counts (``completion_ids``)."""

from __future__ import annotations

from typing import Any

from grpo.rewards.registry import RewardError, RewardFn, register


def soft_overlong(length: int, max_length: int, buffer: int) -> float:
    """DAPO: 0 up to max_length - buffer, then linearly down to -1 at max_length, -1 beyond."""
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer
    return -1.0


@register("overlong")
def overlong_reward(max_length: int, buffer: int) -> RewardFn:
    """DAPO soft overlong punishment; usually max_length = rollout.max_new_tokens."""
    if not 0 < buffer <= max_length:
        raise RewardError(
            f"reward 'overlong': need 0 < buffer <= max_length, got {buffer}, {max_length}"
        )

    def score(
        completions: list[str], *, completion_ids: list[list[int]], **_: Any
    ) -> list[float | None]:
        return [soft_overlong(len(ids), max_length, buffer) for ids in completion_ids]

    return score


@register("token_budget")
def token_budget_reward(budget: int, per_token: float = 0.01, max_penalty: float = 1.0) -> RewardFn:
    """-per_token for each token beyond `budget`, floored at -max_penalty."""
    if budget < 0 or per_token < 0 or max_penalty < 0:
        raise RewardError("reward 'token_budget': budget, per_token and max_penalty must be >= 0")

    def score(
        completions: list[str], *, completion_ids: list[list[int]], **_: Any
    ) -> list[float | None]:
        return [-min(max_penalty, per_token * max(0, len(ids) - budget)) for ids in completion_ids]

    return score


def repeated_fraction(units: list[Any], n: int) -> float:
    """1 - distinct n-grams / n-grams: 0 for no repetition, towards 1 for a loop."""
    grams = [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


UNITS = {
    "words": lambda text, ids: text.split(),
    "tokens": lambda text, ids: ids,
}


@register("repetition")
def repetition_reward(n: int = 3, max_penalty: float = -1.0, unit: str = "words") -> RewardFn:
    """max_penalty x repeated n-gram fraction (of words or tokens); 0 for no repetition."""
    if n < 1 or max_penalty > 0 or unit not in UNITS:
        raise RewardError(
            f"reward 'repetition': need n >= 1, max_penalty <= 0, unit in {list(UNITS)}; got {n}, {max_penalty}, {unit}"
        )
    split = UNITS[unit]

    def score(
        completions: list[str], *, completion_ids: list[list[int]], **_: Any
    ) -> list[float | None]:
        return [
            max_penalty * repeated_fraction(split(text, ids), n)
            for text, ids in zip(completions, completion_ids, strict=True)
        ]

    return score
