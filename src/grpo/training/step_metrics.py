"""A step's metrics and sampled completions, as pure functions of what the step scored."""

from __future__ import annotations

import math
from typing import Any

from grpo import algorithm
from grpo.rewards.inputs import per_function_metrics
from grpo.rollout.turns import tool_metrics
from grpo.runs.metrics import reflection_rate
from grpo.step_data import Scored
from grpo.training.prompt_selection import Collected


def step_metrics(scored: Scored) -> dict[str, float]:
    """Rewards, advantages and completions of every group rolled out (see docs/metrics.md)."""
    rollout = scored.rollout
    g = rollout.group_size
    out: dict[str, float] = {
        "reward/mean": float(scored.rewards.mean()),
        "reward/std": float(scored.rewards.std(unbiased=False)),
        "frac_zero_std": float((algorithm.group_std(scored.rewards, g) < 1e-6).float().mean()),
        "advantage/abs_mean": float(scored.advantages.abs().mean()),
        "completion_len/mean": float(rollout.completion_mask.sum(dim=1).float().mean()),
        "truncated_frac": float(rollout.truncated.float().mean()),
        "reflection_rate": reflection_rate(rollout.completions),
    }
    if rollout.turns is not None:
        out.update(tool_metrics(rollout.turns))
    functions = per_function_metrics(scored.per_function, scored.function_names)
    for name in scored.function_names:
        out[f"reward/{name}/mean"] = functions[f"reward/{name}/mean"]
        out[f"reward/{name}/std"] = functions[f"reward/{name}/std"]
        out[f"reward/{name}/errors"] = float(scored.errors.get(name, 0))
    return out


def sampling_metrics(
    batch: Collected, dynamic: bool, greso: bool, skipped: float, group_size: int
) -> dict[str, float]:
    """Dynamic sampling's and GRESO's counts for the step (none when both are off)."""
    out: dict[str, float] = {}
    if dynamic:
        out["sampling/prompts_drawn"] = float(batch.prompts_drawn)
        out["sampling/prompts_kept"] = float(batch.prompts_kept)
        out["sampling/rounds"] = float(batch.rounds)
    if greso:
        out["greso/skipped"] = skipped
        out["greso/rollouts_saved"] = skipped * group_size
    return out


def completion_records(scored: Scored, step: int, n: int) -> list[dict[str, Any]]:
    """The first ``n`` completions of the step as ``completions/`` records."""
    rollout = scored.rollout
    records = []
    for i in range(min(n, rollout.num_completions)):
        per_function = scored.per_function[i].tolist()
        records.append(
            {
                "step": step,
                "prompt": rollout.prompts[i],
                "completion": rollout.completions[i],
                "reward": float(scored.rewards[i]),
                "rewards": {
                    name: None if math.isnan(v) else v
                    for name, v in zip(scored.function_names, per_function, strict=True)
                },
                "advantage": float(scored.advantages[i]),
                "truncated": bool(rollout.truncated[i]),
            }
        )
        if rollout.turns is not None:
            records[-1]["turns"] = rollout.turns[i]
        if rollout.policy_version is not None:  # sampled ahead (rollout.max_staleness)
            records[-1]["policy_version"] = rollout.policy_version
    return records
