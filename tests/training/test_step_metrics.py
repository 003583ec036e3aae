"""A step's metrics and completion records as pure functions of a hand-made scored batch and
the step's typed results."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from grpo.config import build_config
from grpo.step_data import Rollout, Scored
from grpo.training.producer import Ahead, ProducedStep
from grpo.training.prompt_selection import Collected
from grpo.training.step_metrics import (
    completion_records,
    logged_metrics,
    sampling_metrics,
    step_metrics,
)

NAN = math.nan


def _scored() -> Scored:
    """Two groups of G = 2; completion lengths 3, 1, 2, 2; the second completion truncated.
    Rewards 1, 0 | 0.5, 0.5; "fmt" did not apply to the first and last completions."""
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    rollout = Rollout(
        prompt_ids=torch.ones(4, 2, dtype=torch.long),
        prompt_mask=torch.ones(4, 2, dtype=torch.bool),
        completion_ids=torch.ones(4, 3, dtype=torch.long),
        completion_mask=completion_mask,
        truncated=torch.tensor([False, True, False, False]),
        prompts=["p0", "p0", "p1", "p1"],
        completions=["Wait, it is 2", "2", "hmm, 4", "4"],
        rows=[{"prompt": "p0"}, {"prompt": "p1"}],
        group_size=2,
    )
    return Scored(
        rollout=rollout,
        per_function=torch.tensor([[1.0, NAN], [0.0, 1.0], [0.5, 0.0], [0.5, NAN]]),
        function_names=["acc", "fmt"],
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]),
        advantages=torch.tensor([1.0, -1.0, 0.0, 0.0]),
        errors={"fmt": 2},
    )


def test_step_metrics_by_hand() -> None:
    metrics = step_metrics(_scored())
    assert metrics == pytest.approx(
        {
            "reward/mean": 0.5,
            # deviations 0.5, 0.5, 0, 0: population variance 0.125
            "reward/std": math.sqrt(0.125),
            "frac_zero_std": 0.5,  # the second group's rewards are equal
            "advantage/abs_mean": 0.5,
            "completion_len/mean": 2.0,  # (3 + 1 + 2 + 2) / 4
            "truncated_frac": 0.25,
            "reflection_rate": 0.5,  # "Wait" and "hmm"
            "reward/acc/mean": 0.5,
            "reward/acc/std": math.sqrt(0.125),
            # over the completions it applied to: 1 and 0
            "reward/fmt/mean": 0.5,
            "reward/fmt/std": 0.5,
            "reward/acc/errors": 0.0,
            "reward/fmt/errors": 2.0,
            "reward/unscored_frac": 0.0,  # "acc" scored every completion
        }
    )
    unscored = _scored()
    unscored.per_function[3, 0] = NAN  # now neither function scored the last completion
    assert step_metrics(unscored)["reward/unscored_frac"] == 0.25


def test_a_multi_turn_step_adds_the_tool_metrics() -> None:
    scored = _scored()
    ran = {"text": "t", "call": "1", "output": "1", "error": None, "time_s": 0.5}
    answer = {"text": "a", "call": None, "output": None, "error": None, "time_s": None}
    turns = [[ran, answer], [answer], [dict(ran, error="boom"), answer], [answer]]
    scored = dataclasses.replace(scored, rollout=dataclasses.replace(scored.rollout, turns=turns))
    metrics = step_metrics(scored)
    tools = {k: v for k, v in metrics.items() if k.startswith("tools/")}
    assert tools == pytest.approx(
        {
            "tools/calls_per_completion": 0.5,  # 2 calls ran over 4 completions
            "tools/call_frac": 0.5,
            "tools/error_rate": 0.5,
            "tools/time_s": 1.0,
            "tools/turns_per_completion": 1.5,
        }
    )
    assert metrics["reward/mean"] == 0.5  # the rest as without turns


def test_sampling_metrics_only_for_what_is_on() -> None:
    batch = Collected(None, _scored(), prompts_drawn=6, prompts_kept=4, rounds=2)
    assert sampling_metrics(batch, False, False, 3.0, 4) == {}
    assert sampling_metrics(batch, True, False, 3.0, 4) == {
        "sampling/prompts_drawn": 6.0,
        "sampling/prompts_kept": 4.0,
        "sampling/rounds": 2.0,
    }
    # 3 prompts skipped by GRESO saved 3 x G = 12 completions
    assert sampling_metrics(batch, False, True, 3.0, 4) == {
        "greso/skipped": 3.0,
        "greso/rollouts_saved": 12.0,
    }


def test_completion_records_are_the_first_n_with_none_for_not_applicable() -> None:
    records = completion_records(_scored(), step=5, n=2)
    assert records == [
        {
            "step": 5,
            "prompt": "p0",
            "completion": "Wait, it is 2",
            "reward": 1.0,
            "rewards": {"acc": 1.0, "fmt": None},
            "advantage": 1.0,
            "truncated": False,
        },
        {
            "step": 5,
            "prompt": "p0",
            "completion": "2",
            "reward": 0.0,
            "rewards": {"acc": 0.0, "fmt": 1.0},
            "advantage": -1.0,
            "truncated": True,
        },
    ]
    assert len(completion_records(_scored(), step=5, n=10)) == 4  # no more than there are


def test_completion_records_of_a_multi_turn_step_hold_the_turns() -> None:
    scored = _scored()
    turns = [[{"text": f"turn of {i}"}] for i in range(4)]
    scored = dataclasses.replace(scored, rollout=dataclasses.replace(scored.rollout, turns=turns))
    records = completion_records(scored, step=1, n=4)
    assert [r["turns"] for r in records] == turns


def test_logged_metrics_in_the_order_and_with_the_values_the_step_logs() -> None:
    scored = _scored()
    batch = Collected(None, scored, prompts_drawn=2, prompts_kept=0, rounds=1)
    config = build_config({"sampling": {"dynamic": True}, "rollout": {"group_size": 2}})
    produced = ProducedStep(batch, 0.9, rollout_s=3.0, reward_s=1.0, skipped=0.0)
    update = {"optim/skipped": 1.0}
    refreshed = {"ref/refreshes": 2.0}
    metrics = logged_metrics(
        produced, scored, update, refreshed, lr=1e-5, train_s=0.5, elapsed_s=4.0, config=config
    )
    ahead_keys = ["staleness/mean", "staleness/max", "time/wait_rollout_s", "time/wait_train_s"]
    assert list(metrics) == [
        "ref/refreshes",
        *step_metrics(scored),
        "optim/skipped",
        "sampling/prompts_drawn",
        "sampling/prompts_kept",
        "sampling/rounds",
        "rollout/temperature",
        "lr",
        "time/rollout_s",
        "time/reward_s",
        "time/train_s",
        "tokens_per_s",
    ]
    assert metrics["rollout/temperature"] == 0.9 and metrics["lr"] == 1e-5
    assert (metrics["time/rollout_s"], metrics["time/reward_s"], metrics["time/train_s"]) == (
        3.0,
        1.0,
        0.5,
    )
    assert metrics["tokens_per_s"] == 8 / 4.0  # completion tokens 3 + 1 + 2 + 2 in 4 s
    # made ahead by the producer process: its staleness and both waits follow
    ahead = dataclasses.replace(produced, ahead=Ahead(2.0, 0.25, 0.75))
    metrics = logged_metrics(
        ahead, scored, update, refreshed, lr=1e-5, train_s=0.5, elapsed_s=4.0, config=config
    )
    assert list(metrics)[-4:] == ahead_keys
    assert [metrics[k] for k in ahead_keys] == [2.0, 2.0, 0.25, 0.75]
