"""Per-token log-probs (and entropy) of completion tokens only.

Completions that share a prompt (a group's G samples) are packed into one sequence: the prompt
once, then each completion, with an attention mask that lets every completion see the prompt and
its own earlier tokens, nothing else. A group then costs one prompt forward (and backward) instead
of G, and no position is spent on padding. The LM head runs only on the positions that predict
completion tokens (``logits_to_keep``), and the log-softmax is taken a few positions at a time
through ``logsumexp``, so no float32 [positions, vocab] log-softmax is ever materialised. Logits
go through the sampling controls the engine used (temperature, and when set repetition penalty,
min-p, top-k, top-p: ``grpo.processors``), so the log-probs are those of the distribution the
tokens were sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo.processors import Sampling, seen_tokens, shape_logits, truncate

# attention implementations that take a custom 4D mask (others get one full sequence per row)
PACKABLE = {"sdpa": torch.bool, "eager": None}


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as `generate` computes them: [B, L] -> [B, L]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def token_logprobs(
    logits: Tensor,
    at: Tensor,
    targets: Tensor,
    sampling: Sampling | float = 1.0,
    with_entropy: bool = False,
    chunk: int = 64,
    history: History | None = None,
) -> tuple[Tensor, Tensor | None]:
    """logits: [M, V] positions; at: [B, T] the position whose logits predict targets [B, T]
    -> log p(target) [B, T] float32, entropy [B, T] or None.

    ``sampling`` (or a bare temperature) says which distribution: the one the engine sampled
    from (``grpo.processors``). The log-normaliser of each position is taken ``chunk`` positions
    at a time, so the float32 temporaries stay small; a position shared by several targets (a
    prompt's last token predicts every completion's first) is normalised once.
    """
    if not isinstance(sampling, Sampling):
        sampling = Sampling(temperature=sampling)
    if not sampling.plain:
        return _processed_logprobs(logits, at, targets, sampling, with_entropy, chunk, history)
    temperature = sampling.temperature
    lse, entropies = [], []
    for start in range(0, logits.shape[0], chunk):
        part = logits[start : start + chunk].float()  # a view when float32
        if temperature != 1.0:  # dividing by 1 would still copy [chunk, V] and keep it for backward
            part = part / temperature
        lse.append(torch.logsumexp(part, dim=-1))
        if with_entropy:
            with torch.no_grad():  # logged and used for token selection, never differentiated
                probs = torch.softmax(part, dim=-1)
                entropies.append(lse[-1] - (probs * part).sum(dim=-1))
    picked = logits[at, targets].float() / temperature  # [B, T]
    logp = picked - torch.cat(lse)[at]
    entropy = torch.cat(entropies)[at] if with_entropy else None
    return logp, entropy


@dataclass
class History:
    """What the repetition penalty reads: each row's prompt and completion.

    prompt_ids/mask: [B, S]; completion_ids/mask: [B, T] (rows as in ``token_logprobs``).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor

    def owners(self, at: Tensor, positions: int) -> tuple[Tensor, Tensor]:
        """For each of ``positions`` logits rows, a (row, index) whose token it predicts: [M] x2.

        Rows that share a position share its history (the prompt), so any owner will do.
        """
        b, t = self.completion_ids.shape
        rows = torch.arange(b, device=at.device)[:, None].expand(b, t)[self.completion_mask]
        index = torch.arange(t, device=at.device)[None, :].expand(b, t)[self.completion_mask]
        row_of = torch.zeros(positions, dtype=torch.long, device=at.device)
        index_of = torch.zeros(positions, dtype=torch.long, device=at.device)
        row_of[at[self.completion_mask]] = rows
        index_of[at[self.completion_mask]] = index
        return row_of, index_of


def _processed_logprobs(
    logits: Tensor,
    at: Tensor,
    targets: Tensor,
    sampling: Sampling,
    with_entropy: bool,
    chunk: int,
    history: History | None,
) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs`` under penalty and truncation (see ``grpo.processors``).

    A target the truncation removed (possible only when the trainer's numbers differ from the
    sampler's) is scored as if its position's kept set included it, so its log-prob stays finite.
    """
    m, vocab = logits.shape
    flat_at = at.flatten()  # [B*T]
    order = torch.argsort(flat_at, stable=True)  # targets grouped by the chunk of their position
    sorted_at = flat_at[order]
    owners = history.owners(at, m) if sampling.repetition_penalty != 1.0 else None
    lse, cutoffs, entropies, picked = [], [], [], []
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        seen = None
        if owners is not None:
            rows, index = owners[0][start:stop], owners[1][start:stop]
            seen = seen_tokens(
                history.prompt_ids[rows],
                history.prompt_mask[rows],
                history.completion_ids[rows],
                index,
                vocab,
            )
        shaped = shape_logits(logits[start:stop].float(), sampling, seen)  # [c, V]
        lo, hi = torch.searchsorted(sorted_at, torch.tensor([start, stop], device=at.device))
        mine = order[lo:hi]
        picked.append(shaped[flat_at[mine] - start, targets.flatten()[mine]])
        part, cutoff = truncate(shaped, sampling)
        lse.append(torch.logsumexp(part, dim=-1))
        if cutoff is not None:
            cutoffs.append(cutoff)
        if with_entropy:
            with torch.no_grad():
                probs = torch.softmax(part, dim=-1)  # 0 on removed tokens
                entropies.append(lse[-1] - (probs * part.nan_to_num(neginf=0.0)).sum(dim=-1))
    target = torch.cat(picked)[torch.argsort(order)].view(at.shape)  # [B, T]
    norm = torch.cat(lse)[at]
    if cutoffs:
        outside = target.detach() < torch.cat(cutoffs)[at]
        norm = torch.where(outside, torch.logaddexp(norm, target), norm)
    entropy = torch.cat(entropies)[at] if with_entropy else None
    return target - norm, entropy


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    sampling: Sampling | float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of each completion token given the prompt and the tokens before it.

    prompt_ids/mask: [B, S] left padded; completion_ids/mask: [B, T] right padded.
    Returns logp [B, T] (and entropy [B, T]); values at masked positions are meaningless.
    Rows are packed by prompt (``pack``) when the model's attention takes a custom mask and has
    no sliding window.
    """
    config = _config(model)
    implementation = getattr(config, "_attn_implementation", None)
    # the custom mask replaces the model's own, a sliding window included: such models (and
    # attention without custom masks) get one full sequence per row
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    if implementation not in PACKABLE or windowed:
        return full_sequence_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            sampling,
            with_entropy,
        )
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask)
    dtype = PACKABLE[implementation] or next(model.parameters()).dtype
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask(dtype),
        position_ids=packed.position_ids,
        logits_to_keep=packed.keep,
        use_cache=False,
    )
    logits = out.logits.reshape(-1, out.logits.shape[-1])  # [U * keep, V]
    history = History(prompt_ids, prompt_mask, completion_ids, completion_mask)
    return token_logprobs(
        logits, packed.at, completion_ids, sampling, with_entropy, history=history
    )


def _config(model: nn.Module):
    return getattr(getattr(model, "module", model), "config", None)  # DDP keeps it on .module


@dataclass
class Packed:
    """Rows of a micro-batch packed by prompt: U sequences of L tokens, left padded.

    Sequence u is its prompt followed by the completions that share it, each without its last
    token (nothing after it is predicted). ``segment`` is 0 on the prompt, k on the k-th
    completion and -1 on padding.
    """

    input_ids: Tensor  # [U, L]
    position_ids: Tensor  # [U, L] a completion's tokens continue its prompt's positions
    segment: Tensor  # [U, L]
    keep: int  # the last ``keep`` positions of every sequence hold all predicting positions
    at: Tensor  # [B, T] index into the [U * keep] kept positions predicting completion token j

    def attention_mask(self, dtype: torch.dtype) -> Tensor:
        """[U, 1, L, L]: a token sees earlier tokens of its own segment and the whole prompt.

        Boolean (True = attend) for SDPA, additive (0 / most negative) for eager attention.
        Padding sees earlier padding, so no row of the softmax is empty.
        """
        n = self.segment.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.segment.device).tril()
        query, key = self.segment[:, :, None], self.segment[:, None, :]
        allowed = (causal & ((key == 0) | (key == query)))[:, None]
        if dtype == torch.bool:
            return allowed
        zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


def pack(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> Packed:
    """Pack rows that share a prompt (see ``Packed``). Shapes as in ``completion_logprobs``."""
    s, device = prompt_ids.shape[1], prompt_ids.device
    distinct, prompt_of_row = torch.unique(
        torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0, return_inverse=True
    )
    # completions are right padded; a completion's last token predicts nothing, so it is left out
    body = [max(n - 1, 0) for n in completion_mask.sum(dim=1).tolist()]
    prompt_len = distinct[:, s:].sum(dim=1).tolist()
    rows_of = [(prompt_of_row == u).nonzero()[:, 0].tolist() for u in range(len(distinct))]
    size = [p + sum(body[r] for r in rows) for p, rows in zip(prompt_len, rows_of, strict=True)]
    longest = max(size)
    keep = max(n - p + 1 for n, p in zip(size, prompt_len, strict=True))
    shape = (len(distinct), longest)
    input_ids = torch.zeros(shape, dtype=torch.long, device=device)
    position_ids = torch.zeros(shape, dtype=torch.long, device=device)
    segment = torch.full(shape, -1, dtype=torch.long, device=device)
    at = torch.zeros(completion_ids.shape, dtype=torch.long, device=device)
    for u, (p, rows) in enumerate(zip(prompt_len, rows_of, strict=True)):
        start = longest - size[u]  # left padding
        kept = u * keep - (longest - keep)  # + a padded position = its index among kept ones
        input_ids[u, start : start + p] = distinct[u, :s][distinct[u, s:].bool()]
        position_ids[u, start : start + p] = torch.arange(p, device=device)
        segment[u, start : start + p] = 0
        start += p
        for k, row in enumerate(rows, start=1):
            n, span = body[row], slice(start, start + body[row])
            input_ids[u, span] = completion_ids[row, :n]
            position_ids[u, span] = p + torch.arange(n, device=device)
            segment[u, span] = k
            at[row] = kept + longest - size[u] + p - 1  # the prompt's last token predicts token 0
            at[row, 1 : 1 + n] = kept + start + torch.arange(n, device=device)
            start += n
    return Packed(input_ids, position_ids, segment, keep, at)


def full_sequence_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    sampling: Sampling | float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs`` as one forward over prompt + completion of every row."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, S+T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    b, t = completion_ids.shape
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=t + 1,  # positions S-1 .. S+T-1; the last one predicts past the end
        use_cache=False,
    )
    logits = out.logits[:, :-1].reshape(b * t, -1)  # position S-1+j predicts completion token j
    at = torch.arange(b * t, device=logits.device).view(b, t)
    history = History(prompt_ids, prompt_mask, completion_ids, completion_mask)
    return token_logprobs(logits, at, completion_ids, sampling, with_entropy, history=history)
