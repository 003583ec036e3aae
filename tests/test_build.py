"""The builder: what eval and curate build, in what order, and what it releases when a part fails."""

from __future__ import annotations

from pathlib import Path

import pytest

import grpo.build
from grpo.build import build_for_sampling
from grpo.config import build_config
from grpo.models import ModelError
from grpo.rewards import RewardError, RewardRunner


def _config(model: Path, **rewards: object):
    return build_config(
        {
            "model": {"name": str(model)},
            "data": {"task": "arithmetic", "task_args": {"size": 8}},
            "rewards": {"functions": [{"name": "format"}], **rewards},
            "train": {"progress": False},
        }
    )


def test_a_bad_reward_is_refused_before_the_model_loads(tiny_model_dir: Path, monkeypatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded before the rewards were checked")

    monkeypatch.setattr(grpo.build, "load_policy", never)
    monkeypatch.setattr(grpo.build, "load_tokenizer", never)
    bad = build_config(
        {
            "model": {"name": str(tiny_model_dir)},
            "rewards": {"functions": [{"name": "no_such_reward"}]},
        }
    )
    with pytest.raises(RewardError, match="unknown reward 'no_such_reward'"):
        build_for_sampling(bad, [])


def test_the_rewards_are_closed_when_the_model_fails_to_load(
    tiny_model_dir: Path, monkeypatch
) -> None:
    closed: list[bool] = []
    real_close = RewardRunner.close

    def close(self: RewardRunner) -> None:
        closed.append(True)
        real_close(self)

    def broken(*args: object, **kwargs: object) -> None:
        raise ModelError("weights are damaged")

    monkeypatch.setattr(RewardRunner, "close", close)
    monkeypatch.setattr(grpo.build, "load_policy", broken)
    with pytest.raises(ModelError, match="damaged"):
        build_for_sampling(_config(tiny_model_dir), [])
    assert closed == [True]


def test_eval_parts_hold_no_engine_and_a_model_in_eval_mode(tiny_model_dir: Path) -> None:
    parts = build_for_sampling(_config(tiny_model_dir), [{"prompt": "What is 1 + 1?"}])
    try:
        assert not parts.policy.training
        assert not hasattr(parts, "engine")  # eval generates itself; curate builds its engine
    finally:
        parts.rewards.close()


def test_a_trainer_that_fails_to_build_stops_its_reward_workers(tiny_config, monkeypatch) -> None:
    from grpo.training import Trainer

    closed: list[bool] = []
    real_close = RewardRunner.close

    def close(self: RewardRunner) -> None:
        closed.append(True)
        real_close(self)

    def broken(*args: object, **kwargs: object) -> None:
        raise ModelError("weights are damaged")

    monkeypatch.setattr(RewardRunner, "close", close)
    monkeypatch.setattr(grpo.build, "load_policy", broken)
    with pytest.raises(ModelError, match="damaged"):
        Trainer(tiny_config())
    assert closed == [True]
