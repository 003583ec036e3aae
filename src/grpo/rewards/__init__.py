"""Reward functions: the protocol, the registry of built-ins, and the runner.

A reward function is any callable
``f(completions: list[str], *, prompts: list, completion_ids: list[list[int]], **columns)
-> list[float | None]`` (user functions get every argument by keyword, as TRL passes them):
dataset columns arrive as keyword lists aligned with ``completions``;
``None`` means "not applicable" (excluded from that function's mean, weighted as 0).
Functions with a true ``batched`` attribute get the whole batch in one call (a reward model,
a reward relative to its group); the others are called one completion at a time, so slow verifiers overlap and one failing
completion falls back alone. Built-ins run in this process; user functions, named by
``module:function`` or ``path/to/file.py:function``, run in worker processes that can be killed
(``RewardRunner``). A built-in with a ``close()`` method is closed with the runner (worker
processes of the math verifier, the reward model's weights).
"""

from typing import TYPE_CHECKING, Any

from grpo.rewards.registry import REGISTRY, RewardError, RewardFn, register, resolve_reward

if TYPE_CHECKING:
    from grpo.rewards.runner import (
        ErrorWatch,
        RewardFailure,
        RewardOutput,
        RewardRunner,
        function_name,
        weighted_total,
    )

__all__ = [
    "REGISTRY",
    "ErrorWatch",
    "RewardError",
    "RewardFailure",
    "RewardFn",
    "RewardOutput",
    "RewardRunner",
    "function_name",
    "register",
    "resolve_reward",
    "weighted_total",
]


def __getattr__(name: str) -> Any:
    # the runner pulls in torch: a reward worker that imports a built-in of this package (the
    # reasoning-gym verifier) starts without it
    if name in __all__:  # the runner's names: the registry's are bound above
        from grpo.rewards import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'grpo.rewards' has no attribute {name!r}")
