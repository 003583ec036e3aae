"""Neural reward: a sequence-classification checkpoint scores prompt + completion (logit 0).

The one reward module that loads a torch model. It is ``batched`` (one call per step, scored in
micro-batches) and runs on the trainer's device unless ``device`` says otherwise. Chat-message
prompts are rendered with the reward model's chat template when it has one.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.rewards.registry import RewardError, RewardFn, register


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class RewardModel:
    """Scores [N] texts with ``model(**batch).logits[:, 0]``."""

    batched = True

    def __init__(
        self, path: str, batch_size: int = 8, max_length: int = 1024, device: str | None = None
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path)
        except OSError as err:
            raise RewardError(
                f"reward 'reward_model': cannot load {path}: {str(err).splitlines()[0]}"
            ) from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = torch.device(device or _default_device())
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        self.max_length = max_length

    def _text(self, prompt: Any, completion: str) -> str:
        if isinstance(prompt, list):  # chat messages
            messages = [*prompt, {"role": "assistant", "content": completion}]
            if self.tokenizer.chat_template:
                return self.tokenizer.apply_chat_template(messages, tokenize=False)
            return "\n".join(m["content"] for m in messages)
        return f"{prompt}{completion}"

    @torch.no_grad()
    def __call__(
        self, completions: list[str], *, prompts: list[Any], **_: Any
    ) -> list[float | None]:
        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float | None] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
            ).to(self.device)
            scores.extend(self.model(**batch).logits[:, 0].float().cpu().tolist())
        return scores

    def close(self) -> None:
        self.model.to("cpu")


@register("reward_model")
def reward_model_reward(
    path: str, batch_size: int = 8, max_length: int = 1024, device: str | None = None
) -> RewardFn:
    """A local sequence-classification folder; logit 0 of prompt + completion is the reward."""
    return RewardModel(path, batch_size, max_length, device)
