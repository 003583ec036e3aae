"""The rewards of a verifiers taskset's tasks (grpo.environments.verifiers), on rows that
``data.task: verifiers`` made (their ``verifiers_taskset`` and ``verifiers_task`` columns):
``verifiers`` pays the task's weighted reward (verifiers' ``trace.reward``), ``verifiers:NAME``
its reward NAME alone, logged as ``reward/NAME``. A completion is scored once for all of them."""

from __future__ import annotations

import functools
from typing import Any

from grpo.rewards.registry import RewardFn, register


@functools.lru_cache(maxsize=4096)
def _scores(spec: str, index: int, completion: str, turns: str | None) -> dict[str, Any]:
    import json

    from grpo.environments.verifiers import score, tasks

    scores = score(spec, index, completion, None if turns is None else json.loads(turns))
    weights = {
        fn.__name__: getattr(fn, "_vf_weight", 1.0) for fn in tasks(spec)[index].hooks("reward")
    }
    known = [(v, weights.get(k, 1.0)) for k, v in scores.items() if v is not None]
    return {**scores, "": sum(v * w for v, w in known) if known else None}


def _rewards(
    name: str,
    completions: list[str],
    verifiers_taskset: list[str],
    verifiers_task: list[int],
    turns: list[Any] | None,
) -> list[Any]:
    import json

    said = turns or [None] * len(completions)
    out = []
    for c, spec, i, t in zip(completions, verifiers_taskset, verifiers_task, said, strict=True):
        scores = _scores(spec, int(i), c, None if t is None else json.dumps(t, default=str))
        if name not in scores:
            given = ", ".join(k for k in scores if k)
            raise ValueError(
                f"verifiers:{name}: task {i} of {spec} gives no reward {name} ({given})"
            )
        out.append(scores[name])
    return out


def verifiers_reward(name: str) -> RewardFn:
    """The reward NAME of the rows' tasks ('' for their weighted sum)."""

    def reward(
        completions: list[str],
        verifiers_taskset: list[str],
        verifiers_task: list[int],
        turns: list[Any] | None = None,
        **_: Any,
    ) -> list[Any]:
        return _rewards(name, completions, verifiers_taskset, verifiers_task, turns)

    reward.__name__ = name or "verifiers"
    return reward


register("verifiers")(functools.partial(verifiers_reward, ""))
