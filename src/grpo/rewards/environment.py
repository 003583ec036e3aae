"""The reward an environment gives its own episodes (``get_reward()`` of a TRL-style class, an
OpenEnv server's step rewards): ``rewards.functions: [{name: environment}]``, combinable with
other rewards and weights like any reward. The turn loop asks each episode for it when the
episode ends (``grpo.environments``); this function hands the values on (the column
``environment_reward``), so a value that is not a finite number is counted as this reward's
error, as any reward's is."""

from __future__ import annotations

from typing import Any

from grpo.rewards.registry import RewardFn, register


# the episode's outcome: what the hack watch reads as the task being learned
@register("environment", kind="accuracy")
def environment_reward() -> RewardFn:
    def environment(
        completions: list[str], environment_reward: list[Any] | None = None, **_: Any
    ) -> list[Any]:
        # None: no episode scored itself (a step of episodes whose reward() failed)
        return list(environment_reward or [None] * len(completions))

    return environment
