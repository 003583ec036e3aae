"""A step's metrics and sampled completions, as pure functions of what the step produced,
scored and updated."""

from __future__ import annotations

import math
from typing import Any

from grpo import algorithm
from grpo.config import Config
from grpo.rewards.inputs import per_function_metrics
from grpo.rollout.turns import env_metrics, tool_metrics
from grpo.runs.metrics import reflection_rate
from grpo.step_data import Scored
from grpo.training.producer import ProducedStep
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
    if rollout.episodes is not None:
        out.update(env_metrics(rollout.turns, rollout.episodes))
    if scored.function_names:  # completions every function returned None for: a total of 0
        out["reward/unscored_frac"] = float(scored.per_function.isnan().all(dim=1).float().mean())
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


def logged_metrics(
    produced: ProducedStep,
    everyone: Scored,
    update: dict[str, float],
    refreshed: dict[str, float],
    *,
    lr: float,
    train_s: float,
    elapsed_s: float,
    config: Config,
) -> dict[str, float]:
    """The step's metrics but the reward-hacking watch's and the step's seconds: ``everyone``,
    every group rolled out (all ranks); ``update``, the update's metrics; ``refreshed``, the
    reference's; ``lr``, the rate the update used; ``train_s``: seconds in the update;
    ``elapsed_s``: seconds from the step's start to the update's end."""
    metrics = dict(refreshed)
    metrics.update(step_metrics(everyone))
    metrics.update(update)
    sampling = config.sampling
    group_size = config.rollout.group_size
    collected, skipped = produced.collected, produced.skipped
    metrics.update(
        sampling_metrics(collected, sampling.dynamic, sampling.greso, skipped, group_size)
    )
    metrics["rollout/temperature"] = produced.temperature
    tokens = float(everyone.rollout.completion_mask.sum())
    metrics.update(
        {
            "lr": lr,
            "time/rollout_s": produced.rollout_s,
            "time/reward_s": produced.reward_s,
            "time/train_s": train_s,
            "tokens_per_s": tokens / max(elapsed_s, 1e-9),
        }
    )
    if produced.ahead is not None:  # a producer process made this step's groups ahead
        ahead = produced.ahead
        metrics.update(
            {
                # one version per step: every rollout of it was sampled with the same weights
                "staleness/mean": ahead.staleness,
                "staleness/max": ahead.staleness,
                "time/wait_rollout_s": ahead.wait_rollout_s,
                "time/wait_train_s": ahead.wait_train_s,
            }
        )
    return metrics


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
