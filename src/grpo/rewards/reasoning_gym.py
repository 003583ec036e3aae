"""reasoning-gym's verifier as a reward (``reasoning_gym``): the generator's own
``score_answer`` on the answer extracted from ``<answer>`` (``extract``, ``last_number`` as the
``accuracy`` reward takes them), for rows of the ``reasoning_gym`` task.

It runs in the user functions' worker processes (``register_in_workers``): a generator's
verifier is third-party code that may hang or raise, so a call is bounded by
``rewards.timeout_s`` and its worker killed and replaced; a raise or a value that is not a
number is a counted reward error.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from grpo.rewards.accuracy import EXTRACTORS, extract_answer
from grpo.rewards.registry import RewardError, RewardFn, register_in_workers

COLUMN = "reasoning_gym"  # the task's column: {dataset, config, entry}


@lru_cache(maxsize=64)
def _scorer(name: str, config_json: str) -> Any:
    """The generator's ``score_answer``, of a dataset made with the rows' config (a verifier may
    read it)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config_json), size=1).score_answer


def score(answer: str | None, row: dict[str, Any]) -> Any:
    """``score_answer(answer, entry)`` of the row's generator; whatever it returns."""
    config = json.dumps(row["config"], sort_keys=True)
    return _scorer(row["dataset"], config)(answer, row["entry"])


@register_in_workers("reasoning_gym", kind="accuracy")
def reasoning_gym_reward(
    extract: list[str] | tuple[str, ...] = ("answer",), last_number: bool = False
) -> RewardFn:
    """``extract``: where the answer is looked for (``accuracy``'s strategies, first found
    wins); ``last_number``: else the last number of the text (lenient: evaluation only)."""
    unknown = [name for name in extract if name not in EXTRACTORS]
    if unknown:
        raise RewardError(
            f"reward 'reasoning_gym': unknown extract {unknown} (known: {', '.join(EXTRACTORS)})"
        )
    strategies = tuple(extract) + (
        ("last_number",) if last_number and "last_number" not in extract else ()
    )

    def reasoning_gym(completions: list[str], **columns: Any) -> list[Any]:
        rows = columns.get(COLUMN) or [None] * len(completions)
        return [
            None if row is None else score(extract_answer(text, strategies), row)
            for text, row in zip(completions, rows, strict=True)
        ]

    reasoning_gym.columns = (COLUMN,)  # type: ignore[attr-defined]
    reasoning_gym.strategies = strategies  # type: ignore[attr-defined]  # maj@k votes by them
    return reasoning_gym
