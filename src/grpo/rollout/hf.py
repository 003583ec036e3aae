"""Rollouts with Hugging Face ``generate`` from the policy being trained."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from grpo.batch import Rollout
from grpo.config import RolloutConfig
from grpo.rollout import completion_mask_and_truncation, decode_completions


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted({*ids, tokenizer.eos_token_id} - {None})


class HFEngine:
    """Samples G completions per prompt from ``model`` (prompts left padded)."""

    def __init__(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos = eos_ids(tokenizer, model)
        self.sampling = dict(
            do_sample=True,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k or None,
            max_new_tokens=config.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=self.eos,
            use_cache=True,
        )

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to do: this engine samples from the policy object itself."""

    @torch.no_grad()
    def generate(self, prompts: list[str], rows: list[dict[str, Any]], group_size: int) -> Rollout:
        enc = self.tokenizer(
            prompts, return_tensors="pt", padding=True, padding_side="left",
            add_special_tokens=False,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=enc.input_ids,
                attention_mask=enc.attention_mask,
                generation_config=GenerationConfig(
                    **self.sampling, num_return_sequences=group_size
                ),
            )
        finally:
            self.model.train(was_training)
        s = enc.input_ids.shape[1]
        completion_ids = out[:, s:]  # [N, T]; num_return_sequences keeps each group contiguous
        mask, truncated = completion_mask_and_truncation(completion_ids, self.eos)
        completion_ids = completion_ids.masked_fill(~mask, self.tokenizer.pad_token_id)
        return Rollout(
            prompt_ids=enc.input_ids.repeat_interleave(group_size, dim=0),
            prompt_mask=enc.attention_mask.bool().repeat_interleave(group_size, dim=0),
            completion_ids=completion_ids,
            completion_mask=mask,
            truncated=truncated,
            prompts=[p for p in prompts for _ in range(group_size)],
            completions=decode_completions(self.tokenizer, completion_ids, mask),
            rows=list(rows),
            group_size=group_size,
        )
