"""The reward model (tiny random classifier built here) and mask_truncated_completions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.config import RewardSpec
from grpo.rewards import resolve_reward


def _tiny_classifier(folder: Path, tiny_model_dir: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.device
def test_reward_model_scores_logit_zero_batched(tmp_path: Path, tiny_model_dir: Path, device):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _tiny_classifier(tmp_path / "rm", tiny_model_dir)
    args = {"path": str(folder), "batch_size": 2, "device": str(device)}
    fn = resolve_reward(RewardSpec(name="reward_model", args=args))
    assert fn.batched
    prompts, completions = ["a=", "b=", "c="], ["1", "22", "333"]
    scores = fn(completions, prompts=prompts)
    # reference: each text alone, no padding, logit 0
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        expected = [
            float(model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0])
            for p, c in zip(prompts, completions, strict=False)
        ]
    assert torch.allclose(torch.tensor(scores), torch.tensor(expected), atol=1e-5)
    fn.close()


def _optimize(config, scored, advantages=None) -> dict[str, float]:
    """One update of a fresh trainer (the same start weights every time) on ``scored``."""
    import dataclasses

    from grpo.training.trainer import Trainer

    if advantages is not None:
        scored = dataclasses.replace(scored, advantages=advantages)
    return Trainer(config).optimize(scored)


def test_mask_truncated_completions_removes_them_from_the_loss(tiny_config, monkeypatch):
    from grpo import algorithm
    from grpo.training.trainer import Trainer

    def config(mask: bool):
        return tiny_config(
            rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
            algorithm={"mask_truncated_completions": mask, "beta": 0.0},
            optim={"micro_batch_size": 8},
        )

    trainer = Trainer(config(True))
    rollout = trainer.producer.rollout()
    # which completions ran out of tokens is all the option reads: mark rows 0, 1 and 6
    truncated = torch.zeros(8, dtype=torch.bool)
    truncated[[0, 1, 6]] = True
    rollout.truncated = truncated
    scored = trainer.producer.score(rollout)
    assert scored.advantages[truncated].abs().min() > 0  # they would carry a gradient

    seen = []
    original = algorithm.policy_loss

    def spy(logp, old_logp, advantages, loss_mask, *args, **kwargs):
        seen.append(loss_mask.clone())
        return original(logp, old_logp, advantages, loss_mask, *args, **kwargs)

    monkeypatch.setattr(algorithm, "policy_loss", spy)
    masked = _optimize(config(True), scored)
    (loss_mask,) = seen  # one micro-batch of all 8 rows, in length order
    assert loss_mask.sum() == scored.rollout.completion_mask[~truncated].sum()

    # grpo's loss counts every sequence in its 1/N: masking a completion is zeroing its
    # advantage (beta 0), so the two updates agree; without the mask the update differs
    zeroed = _optimize(config(False), scored, scored.advantages.masked_fill(truncated, 0.0))
    unmasked = _optimize(config(False), scored)
    for key in ("loss", "grad_norm"):
        assert masked[key] == pytest.approx(zeroed[key], rel=1e-5, abs=1e-7), key
    assert masked["grad_norm"] > 0
    assert abs(unmasked["grad_norm"] - masked["grad_norm"]) > 1e-3 * masked["grad_norm"]


def test_all_truncated_completions_give_no_update(tiny_config):
    from grpo.training.trainer import Trainer

    # 2 new tokens: the random tiny model essentially never stops that early
    def config(mask: bool):
        return tiny_config(
            rollout={"max_new_tokens": 2},
            algorithm={"mask_truncated_completions": mask, "beta": 0.0},
        )

    trainer = Trainer(config(True))
    scored = trainer.producer.score(trainer.producer.rollout())
    assert bool(scored.rollout.truncated.all())  # seeded: none of the 8 completions ended
    assert scored.advantages.abs().min() > 0  # the trainable reward still ranks them
    metrics = trainer.optimize(scored)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    # every token masked: no optimizer step, and the schedule has not advanced
    assert metrics["optim/skipped"] == 1.0 and trainer.state.scheduler.last_epoch == 0
    assert _optimize(config(False), scored)["grad_norm"] > 0
