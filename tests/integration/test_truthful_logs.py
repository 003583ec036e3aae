"""Logs that tell the truth: every pass counts, means divide by counted tokens, k1 warns, and
the network that scores is deterministic (dropout off)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import grpo.training.trainer
import grpo.training.update
from grpo import algorithm
from grpo.training.trainer import Trainer

NOISY_REWARD = '''
def noisy(completions, **kwargs):
    """Almost surely differs within a group, so every group has a gradient."""
    return [float(sum(map(ord, c)) % 7) for c in completions]
'''


@pytest.fixture
def noisy(tmp_path: Path) -> dict:
    path = tmp_path / "noisy_reward.py"
    path.write_text(NOISY_REWARD)
    return {"functions": [{"name": f"{path}:noisy"}]}


def _spy_loss(monkeypatch) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Record (statistics, loss_mask) of every policy_loss call."""
    calls = []
    original = algorithm.policy_loss

    def spy(logp, old_logp, advantages, loss_mask, *args, **kwargs):
        loss, stats = original(logp, old_logp, advantages, loss_mask, *args, **kwargs)
        calls.append((stats, loss_mask.clone()))
        return loss, stats

    monkeypatch.setattr(algorithm, "policy_loss", spy)
    return calls


def _token_mean(calls, key: str) -> float:
    weighted = sum(float(stats[key]) * float(mask.sum()) for stats, mask in calls)
    return weighted / sum(float(mask.sum()) for _, mask in calls)


def test_clip_and_ratio_metrics_cover_every_pass(tiny_config, noisy, monkeypatch) -> None:
    # mu = 3 at a large learning rate: passes 2 and 3 see a moved policy, pass 1 a ratio of 1
    config = tiny_config(
        rewards=noisy,
        algorithm={"num_iterations": 3, "beta": 0.0, "clip_low": 0.01, "clip_high": 0.01},
        optim={"lr": 3e-2, "micro_batch_size": 4},
    )
    trainer = Trainer(config)
    scored = trainer.producer.score(trainer.producer.rollout())
    calls = _spy_loss(monkeypatch)
    metrics = trainer.optimize(scored)
    assert len(calls) == 3 * 2  # 3 passes x 2 micro-batches
    later = [float(s["ratio/max"]) for s, _ in calls[2:]]
    assert max(later) > 1.01  # the later passes did clip: the test is not vacuous
    for key in ("clip_frac/low", "clip_frac/high", "ratio/mean"):
        assert metrics[key] == pytest.approx(_token_mean(calls, key), abs=1e-6), key
    assert metrics["clip_frac/low"] + metrics["clip_frac/high"] > 0
    assert metrics["ratio/max"] == pytest.approx(max(float(s["ratio/max"]) for s, _ in calls))
    assert metrics["ratio/min"] == pytest.approx(min(float(s["ratio/min"]) for s, _ in calls))


def test_means_divide_by_the_tokens_counted(tiny_config, monkeypatch) -> None:
    # mask_truncated_completions with half the completions flagged truncated; the policy's
    # entropy is pinned at 2.0 on every token, so its logged mean must be 2.0 (not 2.0 x the
    # share of tokens left out)
    config = tiny_config(
        algorithm={"mask_truncated_completions": True, "beta": 0.04, "tis_cap": 2.0},
        optim={"micro_batch_size": 4},
    )
    trainer = Trainer(config)
    scored = trainer.producer.score(trainer.producer.rollout())
    n = scored.rollout.num_completions
    truncated = torch.arange(n) % 2 == 0
    sampler = torch.zeros(scored.rollout.completion_ids.shape)
    rollout = dataclasses.replace(scored.rollout, truncated=truncated, sampler_logp=sampler)
    scored = dataclasses.replace(scored, rollout=rollout, advantages=torch.randn(n))

    seen: list[torch.Tensor] = []
    original = grpo.training.update.completion_logprobs

    def pinned_entropy(*args, with_entropy=False, **kwargs):
        logp, entropy = original(*args, with_entropy=with_entropy, **kwargs)
        if with_entropy:
            seen.append(logp.detach().clone())
            entropy = torch.full_like(entropy, 2.0)
        return logp, entropy

    monkeypatch.setattr(grpo.training.update, "completion_logprobs", pinned_entropy)
    calls = _spy_loss(monkeypatch)
    metrics = trainer.optimize(scored)
    counted = [mask for _, mask in calls]
    # truncated rows were left out of the loss
    assert 0 < sum(int(m.sum()) for m in counted) < int(rollout.completion_mask.sum())
    assert metrics["entropy"] == pytest.approx(2.0, abs=1e-6)
    assert metrics["kl"] == pytest.approx(_token_mean(calls, "kl"), abs=1e-7)
    assert metrics["clip_frac/low"] <= 1.0 and metrics["clip_frac/high"] <= 1.0
    # the sampler reported log-prob 0: the mismatch is |logp| over counted tokens
    gaps = torch.cat([logp[mask].abs() for logp, mask in zip(seen, counted, strict=True)])
    assert metrics["tis/mismatch_mean"] == pytest.approx(float(gaps.mean()), rel=1e-5)
    assert metrics["tis/mismatch_max"] == pytest.approx(float(gaps.max()), rel=1e-5)


def test_k1_in_the_loss_warns_once(tiny_config, capsys) -> None:
    Trainer(tiny_config(algorithm={"beta": 0.04, "kl_estimator": "k1"}))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "k1" in ln]
    assert lines == [grpo.training.console.K1_WARNING]
    Trainer(tiny_config(algorithm={"beta": 0.04, "kl_estimator": "k3"}))
    Trainer(tiny_config(algorithm={"beta": 0.0, "kl_estimator": "k1"}))  # no KL in the loss
    # REINFORCE++ puts the (k1, the paper's) KL into the rewards, not the loss
    reinforce_pp = tiny_config(algorithm={"beta": 0.04, "estimator": "reinforce_pp"})
    assert reinforce_pp.algorithm.kl_estimator == "k1"
    Trainer(reinforce_pp)
    assert "k1" not in capsys.readouterr().err


@pytest.mark.parametrize("disable", [True, False])
def test_disable_dropout_makes_training_forwards_deterministic(
    tiny_model_dir: Path, tmp_path: Path, disable: bool
) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.config import ModelConfig
    from grpo.models import load_policy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.attention_dropout = 0.5  # a checkpoint trained with attention dropout
    model.save_pretrained(tmp_path / "dropout")
    policy = load_policy(ModelConfig(disable_dropout=disable), str(tmp_path / "dropout"))
    policy.train()  # the trainer's mode
    ids = torch.randint(10, 60, (2, 16))
    first, second = policy(input_ids=ids).logits, policy(input_ids=ids).logits
    if disable:
        assert torch.equal(first, second)
        with torch.no_grad():
            policy.eval()
            assert torch.allclose(policy(input_ids=ids).logits, first, atol=1e-6)
    else:
        assert (first - second).abs().max() > 1e-3  # dropout is live in training mode


def test_lora_dropout_with_disable_dropout_is_an_error() -> None:
    from grpo.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"model\.lora\.dropout"):
        build_config({"model": {"lora": {"enabled": True, "dropout": 0.1}}})
    build_config({"model": {"disable_dropout": False, "lora": {"enabled": True, "dropout": 0.1}}})
