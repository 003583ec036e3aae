"""Where a completion ends: the model's end-of-sequence ids and the stop strings (``rollout.stop``)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted({*ids, tokenizer.eos_token_id} - {None})


class StopStrings:
    """Whether each row's newest token completed one of ``strings`` (checked after every token).

    Only the last few tokens are decoded: a stop string of n characters spans at most n tokens,
    and an occurrence that ended earlier would have stopped the row then.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: list[str]) -> None:
        self.tokenizer, self.strings = tokenizer, strings
        self.window = max(len(s) for s in strings) + 1

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, t] completion tokens so far -> [b] True where a stop string appeared."""
        texts = self.tokenizer.batch_decode(tokens[:, -self.window :])
        return torch.tensor([any(s in text for s in self.strings) for text in texts])
