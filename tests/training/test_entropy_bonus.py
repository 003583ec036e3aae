"""The entropy bonus through the trainer: the loss loses coef x the entropy, the gradient moves
with it, and an adapted coefficient follows its rule and resumes exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import grpo.training.update as trainer_module
from grpo.config import build_config
from grpo.training.entropy_bonus import EntropyBonus
from grpo.training.trainer import Trainer, train


def test_the_bonus_subtracts_coef_times_the_mean_token_entropy(tiny_config, weights) -> None:
    # dapo averages the step's counted tokens, as the logged entropy does; beta 0, mu 1, the
    # same rollout from the same weights: the loss differs by exactly -coef x entropy, and the
    # entropy's gradient changes the update
    coef = 0.5
    runs = {}
    for c in (0.0, coef):
        config = tiny_config(algorithm={"loss_type": "dapo", "beta": 0.0, "entropy_coef": c})
        trainer = Trainer(config)
        if not runs:
            scored = trainer.producer.score(trainer.producer.rollout())
        start = weights.of(trainer.state.policy)
        metrics = trainer.optimize(scored)
        runs[c] = (metrics, weights.of(trainer.state.policy))
        weights.assert_moved(start, runs[c][1])
    (plain, before), (bonus, after) = runs[0.0], runs[coef]
    assert plain["entropy"] > 1.0  # the random model is far from deterministic
    assert bonus["loss"] == pytest.approx(plain["loss"] - coef * plain["entropy"], abs=1e-5)
    assert bonus["entropy/coef"] == coef and "entropy/coef" not in plain
    weights.assert_moved(before, after, atol=1e-6)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in rows if "loss" in m]


def test_an_adapted_coefficient_follows_its_rule_and_resumes_exactly(tiny_config) -> None:
    # a target above any entropy the model reaches: one step up after every step, from 0 (the
    # bonus is off at the first step); a resumed run continues from the saved coefficient
    algo = {"entropy_target": 50.0, "entropy_coef_step": 0.25, "beta": 0.0}
    straight = train(tiny_config(algorithm=algo, train={"steps": 4, "run_name": "straight"}))
    train(tiny_config(algorithm=algo, train={"steps": 2, "run_name": "resumed"}))
    resumed = train(tiny_config(algorithm=algo, train={"steps": 4, "run_name": "resumed"}))
    a, b = _metrics(straight), _metrics(resumed)
    assert [m["entropy/coef"] for m in a] == pytest.approx([0.0, 0.25, 0.5, 0.75], abs=1e-12)
    for key in ("entropy/coef", "loss", "entropy", "grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key


def test_the_controller_is_silent_when_off_and_restores_only_an_adapted_coefficient() -> None:
    off = EntropyBonus(build_config({}).algorithm)
    assert not off.on and off.observe({"entropy": 1.0}) == {} and off.coef == 0.0
    fixed = EntropyBonus(build_config({"algorithm": {"entropy_coef": 0.1}}).algorithm)
    assert fixed.observe({"entropy": 1.0}) == {"entropy/coef": 0.1} and fixed.coef == 0.1
    fixed.load_state_dict({"coef": 0.7})  # a fixed coefficient is the config's
    assert fixed.coef == 0.1
    algo = {"entropy_coef": 0.1, "entropy_target": 0.5, "entropy_coef_step": 0.04}
    adapted = EntropyBonus(build_config({"algorithm": algo}).algorithm)
    assert adapted.observe({"entropy": 2.0}) == {"entropy/coef": 0.1}
    assert adapted.coef == pytest.approx(0.06, abs=1e-12)  # above the target: one step down
    assert adapted.observe({"entropy": math.nan}) == {"entropy/coef": pytest.approx(0.06)}
    again = EntropyBonus(build_config({"algorithm": algo}).algorithm)
    again.load_state_dict(adapted.state_dict())
    assert again.coef == adapted.coef


def test_without_the_bonus_the_entropy_needs_no_forward_beyond_the_first_pass(
    tiny_config, monkeypatch
) -> None:
    # entropy is asked for on the first pass only (it is logged); with a coefficient, on
    # every pass, since each pass's loss needs it
    asked: list[bool] = []
    real = trainer_module.completion_logprobs

    def recording(*args, **kwargs):
        if torch.is_grad_enabled():
            asked.append(kwargs["with_entropy"])
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "completion_logprobs", recording)
    for coef, want in ((0.0, [True, False]), (0.2, [True, True])):
        asked.clear()
        config = tiny_config(
            algorithm={"num_iterations": 2, "beta": 0.0, "entropy_coef": coef},
            optim={"micro_batch_size": 8},
        )
        trainer = Trainer(config)
        trainer.optimize(trainer.producer.score(trainer.producer.rollout()))
        assert asked == want
