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
        chunk = logits[rows : rows + chunk_rows].float()  # [b, T, V]; a view when float32
        if temperature != 1.0:  # dividing by 1 would still copy [b, T, V] and keep it for backward
            chunk = chunk / temperature
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
    Rows that share a prompt (a group's completions) compute it once: see ``shared_prompt_logprobs``.
    """
    unique, inverse = torch.unique(
        torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0, return_inverse=True
    )
    # gradient checkpointing turns the KV cache off, which the shared path needs
    if len(unique) < len(prompt_ids) and not _checkpointing(model):
        s = prompt_ids.shape[1]
        return shared_prompt_logprobs(
            model,
            unique[:, :s],
            unique[:, s:].bool(),
            inverse,
            completion_ids,
            completion_mask,
            temperature,
            with_entropy,
        )
    return full_sequence_logprobs(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy
    )


def _checkpointing(model: nn.Module) -> bool:
    # transformers 5 renamed the flag; the old name warns
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def full_sequence_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs`` as one forward over prompt + completion of every row."""
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


def shared_prompt_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    prompt_of_row: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs`` with each distinct prompt computed once.

    prompt_ids/mask: [U, S] distinct left-padded prompts; prompt_of_row: [B] index into them;
    completion_ids/mask: [B, T]. The U prompts run through the model once, their KV cache is
    gathered to the B rows, and the completions run on top of it: a group of G completions costs
    one prompt forward (and backward: the gathered cache carries gradients back to it) instead of
    G. Same values as the plain path up to float rounding.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = position_ids_from_mask(prompt_mask)  # [U, S]
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,  # the last prompt position predicts completion token 0
    )
    first = out.logits[:, -1:].index_select(0, prompt_of_row)  # [B, 1, V]
    cache.batch_select_indices(prompt_of_row)
    logp0, ent0 = token_logprobs(first, completion_ids[:, :1], temperature, with_entropy)
    if completion_ids.shape[1] == 1:
        return logp0, ent0
    inputs = completion_ids[:, :-1]  # [B, T-1]: token j predicts token j+1
    mask = torch.cat([prompt_mask[prompt_of_row], completion_mask[:, :-1]], dim=1).long()
    start = positions[prompt_of_row, -1:] + 1  # [B, 1]
    out = model(
        input_ids=inputs,
        attention_mask=mask,
        position_ids=start + torch.arange(inputs.shape[1]),
        cache=cache,
        use_cache=True,
    )
    logp, ent = token_logprobs(out.logits, completion_ids[:, 1:], temperature, with_entropy)
    entropy = torch.cat([ent0, ent], dim=1) if with_entropy else None
    return torch.cat([logp0, logp], dim=1), entropy
