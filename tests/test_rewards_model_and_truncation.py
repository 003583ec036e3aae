"""The reward model (tiny random classifier built here) and mask_truncated_completions."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_reward_model_scores_logit_zero_batched(tmp_path: Path, tiny_model_dir: Path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _tiny_classifier(tmp_path / "rm", tiny_model_dir)
    fn = resolve_reward(
        RewardSpec(
            name="reward_model", args={"path": str(folder), "batch_size": 2, "device": "cpu"}
        )
    )
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


def test_mask_truncated_completions_removes_them_from_the_loss(tiny_config):
    from grpo.trainer import Trainer

    # 2 new tokens: a random tiny model essentially never stops that early, so all are truncated
    config = tiny_config(
        rollout={"max_new_tokens": 2},
        algorithm={"mask_truncated_completions": True, "beta": 0.0},
        train={"steps": 1},
    )
    trainer = Trainer(config)
    run_dir = trainer.train()
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["truncated_frac"] == 1.0  # seeded: none of the 8 completions ended
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
