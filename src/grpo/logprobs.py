"""Per-token log-probs (and entropy) of completion tokens only.

The LM head runs only on the positions that predict completion tokens (``logits_to_keep``), and
the log-softmax is taken a few rows at a time through ``logsumexp``, so no float32
[batch, seq, vocab] log-softmax is ever materialised. Logits are divided by the sampling
temperature, so the log-probs are those of the distribution the tokens were sampled from.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as `generate` computes them: [B, L] -> [B, L]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = 4,
) -> tuple[Tensor, Tensor | None]:
    """logits: [B, T, V], targets: [B, T] -> log p(target) [B, T] float32, entropy [B, T] or None.

    Works ``chunk_rows`` sequences at a time so the float32 temporaries stay small.
    """
    logps, entropies = [], []
    for rows in range(0, logits.shape[0], chunk_rows):
        chunk = logits[rows : rows + chunk_rows].float() / temperature  # [b, T, V]
        lse = torch.logsumexp(chunk, dim=-1)  # [b, T]
        picked = chunk.gather(-1, targets[rows : rows + chunk_rows].unsqueeze(-1)).squeeze(-1)
        logps.append(picked - lse)
        if with_entropy:
            with torch.no_grad():  # logged and used for token selection, never differentiated
                probs = torch.softmax(chunk, dim=-1)  # [b, T, V]
                entropies.append(lse - (probs * chunk).sum(dim=-1))
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(logps), entropy


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of each completion token given the prompt and the tokens before it.

    prompt_ids/mask: [B, S] left padded; completion_ids/mask: [B, T] right padded.
    Returns logp [B, T] (and entropy [B, T]); values at masked positions are meaningless.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, S+T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    t = completion_ids.shape[1]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=t + 1,  # positions S-1 .. S+T-1; the last one predicts past the end
        use_cache=False,
    )
    logits = out.logits[:, :-1]  # [B, T, V]: position S-1+j predicts completion token j
    return token_logprobs(logits, completion_ids, temperature, with_entropy)
