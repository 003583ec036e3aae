"""The reward functions' input contract: what a rollout's completions are judged as, and the
per-function metrics of their scores."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from grpo.data.prompts import scored_texts
from grpo.step_data import Rollout


def reward_inputs(
    rollout: Rollout,
) -> tuple[list[str], list[Any], dict[str, list[Any]], list[list[int]]]:
    """What the reward functions get for a rollout's N = P*G completions: the texts judged (the
    last turn of a multi-turn completion; a single-turn completion with the tag its prompt
    opened), each one's dataset prompt, the dataset columns repeated per completion (and, of a
    multi-turn rollout: ``turns``; ``environment_reward``, what each episode's reward() gave;
    ``environments``, the live environment instances, in the process that made them), and the
    counted completion token ids."""
    g = rollout.group_size
    columns: dict[str, list[Any]] = {}
    keys = dict.fromkeys(key for row in rollout.rows for key in row)  # every row's, in order
    for key in keys:
        if key != "prompt":
            columns[key] = [row.get(key) for row in rollout.rows for _ in range(g)]
    if rollout.turns is not None:
        columns["turns"] = rollout.turns
    episodes = rollout.episodes or []
    if any(e.reward is not None for e in episodes):  # the reward function ``environment``'s
        columns["environment_reward"] = [e.reward for e in episodes]
    if any(e.instance is not None for e in episodes):  # TRL's environment instances
        columns["environments"] = [e.instance for e in episodes]
    ids = [
        ids[mask].tolist()
        for ids, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
    ]
    prompts = [row["prompt"] for row in rollout.rows for _ in range(g)]
    texts = rollout.answers if rollout.turns else scored_texts(rollout.prompts, rollout.answers)
    return texts, prompts, columns, ids


def per_function_metrics(per_function: Tensor, names: list[str]) -> dict[str, float]:
    """``reward/<fn>/mean`` and ``reward/<fn>/std`` (population) of each function over the
    completions it applied to (None, stored as NaN, is left out); NaN when it applied to none.
    per_function: [N, K]."""
    out: dict[str, float] = {}
    for k, name in enumerate(names):
        column = per_function[:, k]
        valid = column[~column.isnan()]
        out[f"reward/{name}/mean"] = float(valid.mean()) if valid.numel() else math.nan
        out[f"reward/{name}/std"] = float(valid.std(unbiased=False)) if valid.numel() else math.nan
    return out
