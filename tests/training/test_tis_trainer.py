"""Truncated importance sampling through the trainer, with a sampler that is another policy."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import grpo.training.trainer
import grpo.training.update
from grpo import algorithm
from grpo.rollout.hf import HFEngine
from grpo.scoring.logprobs import completion_logprobs
from grpo.training.trainer import Trainer


class OtherPolicySampler(HFEngine):
    """Samples from a perturbed copy of the policy and reports that copy's log-probs: a sampler
    whose distribution really differs from the trainer's, token by token (as a stale or
    lower-precision inference engine's does)."""

    def __init__(self, policy, tokenizer, config) -> None:
        other = copy.deepcopy(policy)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        super().__init__(other, tokenizer, config)

    def generate(self, prompts, rows, group_size, seeds=None, temperature=None):
        rollout = super().generate(prompts, rows, group_size, seeds=seeds, temperature=temperature)
        with torch.no_grad():
            logp, _ = self.logprobs(
                rollout.prompt_ids,
                rollout.prompt_mask,
                rollout.completion_ids,
                rollout.completion_mask,
            )
        rollout.sampler_logp = logp.masked_fill(~rollout.completion_mask, 0.0)
        return rollout

    def logprobs(self, *batch):
        return completion_logprobs(self.model, *batch, self.config.temperature)


def _trainer(tiny_config, cap: float | None) -> Trainer:
    config = tiny_config(algorithm={"tis_cap": cap, "beta": 0.0}, optim={"micro_batch_size": 8})
    trainer = Trainer(config)
    trainer.producer.engine = OtherPolicySampler(
        trainer.state.policy, trainer.tokenizer, config.rollout
    )
    return trainer


def test_tis_weights_and_mismatch_against_a_different_sampler(tiny_config, monkeypatch) -> None:
    cap = 1.05
    trainer = _trainer(tiny_config, cap)
    sampler = trainer.producer.engine
    scored = trainer.producer.score(trainer.producer.rollout())
    seen = []
    original_loss, original_logprobs = (
        algorithm.policy_loss,
        grpo.training.update.completion_logprobs,
    )
    batch: list = []

    def logprobs_spy(model, *args, **kwargs):
        batch[:] = args[:4]
        return original_logprobs(model, *args, **kwargs)

    def spy(logp, old_logp, advantages, loss_mask, *args, **kwargs):
        seen.append((logp.detach(), kwargs["importance_weights"], loss_mask, list(batch)))
        return original_loss(logp, old_logp, advantages, loss_mask, *args, **kwargs)

    monkeypatch.setattr(algorithm, "policy_loss", spy)
    monkeypatch.setattr(grpo.training.update, "completion_logprobs", logprobs_spy)
    metrics = trainer.optimize(scored)

    ((logp, weights, mask, mb),) = seen  # one micro-batch of 8 rows
    with torch.no_grad():
        sampler_logp, _ = sampler.logprobs(*mb)  # the sampler's log-probs of these very tokens
    gap = (logp - sampler_logp)[mask]
    assert gap.abs().mean() > 0.01  # the two policies really differ
    # weight = min(pi_old / pi_sampler, cap) per token; on-policy pi_old is the trainer's logp
    expected = torch.exp(gap).clamp(max=cap)
    assert torch.allclose(weights[mask], expected, atol=1e-5)
    capped = weights[mask] == cap
    assert 0 < int(capped.sum()) < int(mask.sum())  # some tokens truncated, some not
    assert metrics["tis/truncated_frac"] == pytest.approx(float(capped.float().mean()), abs=1e-6)
    assert metrics["tis/mismatch_mean"] == pytest.approx(float(gap.abs().mean()), abs=1e-5)
    assert metrics["tis/mismatch_max"] == pytest.approx(float(gap.abs().max()), abs=1e-5)


def test_tis_changes_the_update(tiny_config) -> None:
    # the same rollout (same sampler, same seeds) with and without the correction
    with_tis, without = _trainer(tiny_config, 1.05), _trainer(tiny_config, None)
    a = with_tis.optimize(with_tis.producer.score(with_tis.producer.rollout()))
    b = without.optimize(without.producer.score(without.producer.rollout()))
    assert "tis/mismatch_mean" in a and a["tis/mismatch_mean"] == b["tis/mismatch_mean"]
    assert a["grad_norm"] > 0 and b["grad_norm"] > 0
    assert abs(a["grad_norm"] - b["grad_norm"]) > 1e-3 * b["grad_norm"]


def test_sequence_masking_and_offpolicy_masking_reach_the_loss(tiny_config, monkeypatch) -> None:
    # sequence-level weights masked outside [0.85, 1.06] and off-policy masking at delta 0.1,
    # against a sampler that really is another policy: the weights policy_loss receives and
    # the logged shares equal a slow loop over completions written here
    config = tiny_config(
        algorithm={
            "beta": 0.0,
            "tis_cap": 1.06,
            "tis_low": 0.85,
            "tis_level": "sequence",
            "tis_mode": "mask",
            "offpolicy_mask_delta": 0.1,
        },
        optim={"micro_batch_size": 8},
    )
    trainer = Trainer(config)
    trainer.producer.engine = OtherPolicySampler(
        trainer.state.policy, trainer.tokenizer, config.rollout
    )
    scored = trainer.producer.score(trainer.producer.rollout())
    seen = []
    original_loss = algorithm.policy_loss

    def spy(logp, old_logp, advantages, loss_mask, *args, **kwargs):
        seen.append((logp.detach(), advantages, loss_mask, kwargs["importance_weights"]))
        return original_loss(logp, old_logp, advantages, loss_mask, *args, **kwargs)

    cuts = []
    original_cut = grpo.training.update.micro_batches

    def cut_spy(*args, **kwargs):
        cuts.append(original_cut(*args, **kwargs))
        return cuts[-1]

    monkeypatch.setattr(algorithm, "policy_loss", spy)
    monkeypatch.setattr(grpo.training.update, "micro_batches", cut_spy)
    metrics = trainer.optimize(scored)

    ((logp, adv, mask, weights),) = seen  # one micro-batch of 8 rows, on-policy: old = logp
    ((mb,),) = cuts
    rows = mb.index.tolist()  # the rollout row of each micro-batch row
    sampler = scored.rollout.sampler_logp
    masked_tokens = dropped = 0
    for k, row in enumerate(rows):
        n = int(mask[k].sum())
        gap = [float(logp[k, t] - sampler[row, t]) for t in range(n)]  # log pi_old - log pi_s
        w = math.exp(sum(gap) / n)  # the geometric mean of the token ratios
        keep_w = 0.85 <= w <= 1.06
        masked_tokens += 0 if keep_w else n
        far = -sum(gap) / n > 0.1  # mean log pi_sampler - log pi_current
        drop = float(adv[k]) < 0 and far
        dropped += drop
        expected = w if keep_w and not drop else 0.0
        assert torch.allclose(weights[k, :n], torch.full((n,), expected), atol=1e-5), k
    total = int(mask.sum())
    assert 0 < masked_tokens < total  # the bounds really cut some sequences and kept others
    assert 0 < dropped < len(rows)  # some negative samples dropped, not all rows
    assert metrics["tis/masked_frac"] == pytest.approx(masked_tokens / total, abs=1e-6)
    assert metrics["tis/offpolicy_masked_frac"] == pytest.approx(dropped / len(rows), abs=1e-6)
    assert "tis/truncated_frac" not in metrics  # mask mode truncates nothing


def test_the_off_policy_mask_without_sampler_log_probs_measures_against_the_old_policy() -> None:
    # a rollout without the sampler's log-probs: the behaviour policy is the one the old
    # log-probs came from, so a completion whose log-probs moved away from them is masked
    from grpo.config import AlgorithmConfig
    from grpo.training import importance

    cfg = AlgorithmConfig(offpolicy_mask_delta=0.1)
    old = torch.zeros(2, 3)
    logp = torch.tensor([[-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])  # row 0 moved: KL 0.5 > 0.1
    mask = torch.ones(2, 3, dtype=torch.bool)
    weights, shares = importance.correction(cfg, logp, old, None, torch.tensor([-1.0, -1.0]), mask)
    assert weights.tolist() == [[0.0] * 3, [1.0] * 3]
    assert shares["tis/offpolicy_masked_frac"] == (1.0, 2.0)


@pytest.mark.parametrize(
    ("sampler", "cap", "low"),
    [(True, None, None), (False, 2.0, None), (False, None, 0.5)],
    ids=["no-bound", "cap-without-sampler", "low-without-sampler"],
)
def test_no_importance_weights_without_a_bound_and_the_samplers_log_probs(sampler, cap, low):
    # the truncated correction needs both: a bound asked for, and the engine's own log-probs
    # of what it sampled; without either (and no off-policy mask) the loss is unweighted
    from grpo.config import AlgorithmConfig
    from grpo.training import importance

    mode = "mask" if low is not None else "truncate"
    cfg = AlgorithmConfig(tis_cap=cap, tis_low=low, tis_mode=mode)
    old = torch.zeros(2, 3)
    behaviour = torch.full((2, 3), -1.0) if sampler else None
    mask = torch.ones(2, 3, dtype=torch.bool)
    got = importance.correction(cfg, old, old, behaviour, torch.tensor([1.0, -1.0]), mask)
    assert got == (None, {})
