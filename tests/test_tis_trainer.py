"""Truncated importance sampling through the trainer, with an engine that reports its log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from grpo import algorithm
from grpo.logprobs import completion_logprobs
from grpo.rollout.hf import HFEngine
from grpo.trainer import Trainer


class ShiftedSampler(HFEngine):
    """HF sampling, reporting log-probs offset by ``shift``: a sampler/trainer mismatch we know."""

    shift = 0.0

    def generate(self, prompts, rows, group_size, seeds=None):
        rollout = super().generate(prompts, rows, group_size, seeds=seeds)
        with torch.no_grad():
            logp, _ = completion_logprobs(
                self.model,
                rollout.prompt_ids,
                rollout.prompt_mask,
                rollout.completion_ids,
                rollout.completion_mask,
                self.config.temperature,
            )
        rollout.sampler_logp = logp + self.shift
        return rollout


@pytest.mark.parametrize(
    ("shift", "cap", "weight"),
    [
        (0.3, 2.0, math.exp(-0.3)),  # sampler overestimates: weight e^-0.3 = 0.741, under the cap
        (-0.3, 1.2, 1.2),  # sampler underestimates: e^0.3 = 1.350 is truncated to the cap 1.2
    ],
)
def test_tis_weights_and_mismatch(
    tiny_config, monkeypatch, shift: float, cap: float, weight: float
) -> None:
    config = tiny_config(algorithm={"tis_cap": cap, "beta": 0.0})
    trainer = Trainer(config)
    trainer.engine = ShiftedSampler(trainer.policy, trainer.tokenizer, config.rollout)
    trainer.engine.shift = shift
    seen = []
    original = algorithm.policy_loss

    def spy(logp, old_logp, advantages, loss_mask, *args, **kwargs):
        seen.append((kwargs["importance_weights"], loss_mask))
        return original(logp, old_logp, advantages, loss_mask, *args, **kwargs)

    monkeypatch.setattr(algorithm, "policy_loss", spy)
    scored = trainer.score(trainer.rollout())
    metrics = trainer.optimize(scored)
    # weight = min(pi_old / pi_sampler, cap) = min(e^-shift, cap) on every counted token
    for weights, mask in seen:
        assert torch.allclose(weights[mask], torch.full_like(weights[mask], weight), atol=1e-5)
    assert metrics["tis/mismatch_mean"] == pytest.approx(abs(shift), abs=1e-5)
    assert metrics["tis/mismatch_max"] == pytest.approx(abs(shift), abs=1e-5)
