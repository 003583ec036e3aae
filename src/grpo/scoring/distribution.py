"""The distribution a token is sampled from, as pure functions of the logits.

Both engines sample from ``process_logits(logits)`` and the trainer scores completions with the
same function, so a log-prob means one thing everywhere: the log-prob under the distribution the
token was actually drawn from, after repetition penalty, temperature, min-p, top-k and top-p.
The order is vLLM's (``vllm/v1/sample/sampler.py``): the penalty on the raw logits, then the
temperature, then min-p, then top-k, then top-p on what is left. Every truncation keeps the
largest logits, so a position's kept set is "every token at or above a cutoff": the trainer
stores one cutoff per position instead of a [positions, vocab] mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Decoding:
    """The decoding controls that shape the distribution (see ``rollout.*`` in the config)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def truncates(self) -> bool:
        """Whether some tokens get probability 0 (their log-prob is renormalised away)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    @property
    def plain(self) -> bool:
        """Temperature only: log-probs are a scaled log-softmax, no per-token history needed."""
        return not self.truncates and self.repetition_penalty == 1.0


def penalise(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Repetition penalty (CTRL; as vLLM and transformers apply it): a logit of a token already in
    the prompt or the completion so far is divided by ``penalty`` when positive, multiplied when
    not. logits, seen: [M, V] (or any equal shapes)."""
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


@torch.no_grad()
def removed_tokens(logits: Tensor, decoding: Decoding) -> Tensor:
    """[M, V] tempered logits -> [M, V] True where min-p, top-k or top-p removes the token.

    Ties at a cutoff are kept; the most likely token is never removed.
    """
    removed = torch.zeros_like(logits, dtype=torch.bool)
    if decoding.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        removed |= probs < decoding.min_p * probs.max(dim=-1, keepdim=True).values
    if 0 < decoding.top_k < logits.shape[-1]:
        kth = logits.masked_fill(removed, -math.inf).topk(decoding.top_k, dim=-1).values[:, -1:]
        removed |= logits < kth
    if decoding.top_p < 1:
        ascending, order = logits.masked_fill(removed, -math.inf).sort(dim=-1)
        # the least likely tokens whose total mass stays within 1 - top_p go
        drop = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - decoding.top_p
        drop[:, -1] = False
        removed |= torch.zeros_like(drop).scatter_(-1, order, drop)
    return removed


def shape_logits(logits: Tensor, decoding: Decoding, seen: Tensor | None = None) -> Tensor:
    """Repetition penalty then temperature: [M, V] float logits -> [M, V] (differentiable).

    ``seen`` [M, V]: tokens already in the prompt or the completion at each position (needed
    when repetition_penalty != 1).
    """
    if decoding.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty needs the tokens seen at each position")
        logits = penalise(logits, seen, decoding.repetition_penalty)
    if decoding.temperature != 1.0:
        logits = logits / decoding.temperature
    return logits


def truncate(logits: Tensor, decoding: Decoding) -> tuple[Tensor, Tensor | None]:
    """Shaped logits [M, V] -> (logits with removed tokens at -inf, cutoff [M] or None).

    ``cutoff`` is the smallest logit still kept (None when nothing truncates). Which tokens are
    kept is a fixed choice, not differentiated; the kept logits stay differentiable.
    """
    if not decoding.truncates:
        return logits, None
    removed = removed_tokens(logits.detach(), decoding)
    with torch.no_grad():
        cutoff = logits.masked_fill(removed, math.inf).amin(dim=-1)
    return logits.masked_fill(removed, -math.inf), cutoff


def process_logits(logits: Tensor, decoding: Decoding, seen: Tensor | None = None) -> Tensor:
    """[M, V] raw logits -> the logits of the distribution sampled from (removed tokens -inf)."""
    return truncate(shape_logits(logits, decoding, seen), decoding)[0]


def token_set(ids: Tensor, counted: Tensor, vocab: int) -> Tensor:
    """The tokens at counted positions: ids [M, L], counted [M, L] (True where a token counts)
    -> [M, V] bool. The sampler's and the scorer's repetition penalty both read this.

    Every write is True, so a token repeated at counted and uncounted positions (the pad id is
    also a real token: `<|im_end|>` on SmolLM2) gets the same answer in any write order, on any
    device; uncounted positions write into a spare column, cut off.
    """
    spare = torch.where(counted.bool(), ids, vocab)  # [M, L]
    seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, spare, True)[:, :vocab]


def seen_tokens(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, upto: Tensor, vocab: int
) -> Tensor:
    """Tokens seen before each position: the prompt (padding excluded) and the first ``upto``
    completion tokens.

    prompt_ids/mask: [M, S]; completion_ids: [M, T]; upto: [M] -> [M, V] bool.
    """
    before = torch.arange(completion_ids.shape[1], device=upto.device) < upto[:, None]  # [M, T]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [M, S + T]
    return token_set(ids, torch.cat([prompt_mask.bool(), before], dim=1), vocab)
