"""Per-token log-probs (and entropy) of completion tokens only.

Completions that share a prompt (a group's G samples) are packed into one sequence: the prompt
once, then each completion, each completion seeing the prompt and its own earlier tokens, nothing
else. A group then costs one prompt forward (and backward) instead of G, and no position is spent
on padding. Models the trainer loads attend with ``grpo.prefix_attention``: each completion as a
short row over its prompt, no mask; others take a dense [L, L] mask (a group of L tokens), whose
attention covers the whole square. Either way, for long completions a cost rule
(``ScoringCost.packing_pays``, priced for the square, so conservative for prefix attention) gives
the group one row per completion instead: the prompt repeated, no mask at all (plain causal
attention), memory linear in the tokens scored. The LM
head runs only on the positions that predict completion tokens (``logits_to_keep``), and the
log-softmax is taken a few positions at a time through ``logsumexp``, so no float32
[positions, vocab] log-softmax is ever materialised. Logits go through the sampling controls the
engine used (temperature, and when set repetition penalty, min-p, top-k, top-p:
``grpo.processors``), so the log-probs are those of the distribution the tokens were sampled
from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo.prefix_attention import PREFIX, prefix_layout
from grpo.processors import Sampling, seen_tokens, shape_logits, truncate

# attention implementations that take a custom 4D mask (others get one full sequence per row);
# PREFIX takes a packed layout instead, and the mask only when it cannot (attention dropout)
PACKABLE = {"sdpa": torch.bool, "eager": None, PREFIX: torch.bool}


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
    # one split, not a slice per chunk: a slice's backward writes its gradient into a zero
    # tensor of the whole [M, V] logits, so slicing cost O(M^2 V / chunk) in backward (larger
    # micro-batches were slower per token); split's backward concatenates the chunks once
    for part in logits.split(chunk):
        part = part.float()  # a view when float32
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
    # targets grouped by the chunk of their position; any order within a position will do, since
    # each value is put back in its place by the inverse permutation
    order = torch.argsort(flat_at)
    sorted_at = flat_at[order]
    owners = history.owners(at, m) if sampling.repetition_penalty != 1.0 else None
    lse, cutoffs, entropies, picked = [], [], [], []
    for k, part in enumerate(logits.split(chunk)):  # one split: see token_logprobs
        start = k * chunk
        stop = start + part.shape[0]
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
        shaped = shape_logits(part.float(), sampling, seen)  # [c, V]
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
    Rows that share a prompt are packed (``pack``) while that costs less than one row per
    completion (``packing_pays``); other groups get one unmasked row per completion
    (``group_rows_logprobs``). Models that cannot take the packed mask get one padded row per
    completion (``scoring_path`` says which and why).
    """
    if scoring_path(model)[0] != "packed":
        return full_sequence_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            sampling,
            with_entropy,
        )
    distinct, prompt_of_row = torch.unique(
        torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0, return_inverse=True
    )
    lengths = completion_mask.sum(dim=1)
    cost = ScoringCost.of(_config(model))
    packed_rows: list[Tensor] = []
    row_groups: list[tuple[Tensor, Tensor]] = []
    for u in range(len(distinct)):
        rows = (prompt_of_row == u).nonzero()[:, 0]
        prompt = distinct[u, : prompt_ids.shape[1]][distinct[u, prompt_ids.shape[1] :].bool()]
        if cost.packing_pays(len(prompt), lengths[rows].tolist()):
            packed_rows.append(rows)
        else:
            row_groups.append((rows, prompt))
    parts: list[tuple[Tensor, tuple[Tensor, Tensor | None]]] = []
    if packed_rows:
        rows = torch.cat(packed_rows)
        every = len(rows) == len(prompt_ids)
        ids, pm, cids, cm = (
            (prompt_ids, prompt_mask, completion_ids, completion_mask)
            if every
            else (prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows])
        )
        result = packed_logprobs(model, ids, pm, cids, cm, sampling, with_entropy)
        if every:
            return result
        parts.append((rows, result))
    for rows, prompt in row_groups:
        result = group_rows_logprobs(
            model, prompt, completion_ids[rows], lengths[rows], sampling, with_entropy
        )
        parts.append((rows, result))
    return _merge(parts, completion_ids.shape[1], with_entropy)


def _merge(
    parts: list[tuple[Tensor, tuple[Tensor, Tensor | None]]],
    t: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Rows scored in separate forwards back in their places: [B, T] (and entropy)."""
    order = torch.cat([rows for rows, _ in parts])
    where = torch.empty_like(order)
    where[order] = torch.arange(len(order), device=order.device)

    def column(k: int) -> Tensor:
        padded = [nn.functional.pad(r[k], (0, t - r[k].shape[1])) for _, r in parts]
        return torch.cat(padded)[where]

    return column(0), column(1) if with_entropy else None


def scoring_path(model: nn.Module) -> tuple[str, str]:
    """("packed" | "rows", why): how ``completion_logprobs`` scores this model's completions."""
    config = _config(model)
    implementation = getattr(config, "_attn_implementation", None)
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    if implementation not in PACKABLE:
        return "rows", f"{implementation} attention takes no custom mask"
    if windowed:
        # the custom mask would replace the model's own, sliding window included
        return "rows", "the model has a sliding window, which the packed mask would replace"
    how = (
        "prefix attention: each completion reads its prompt and its own tokens, no [L, L] mask"
        if implementation == PREFIX
        else f"{implementation} attention takes a custom mask"
    )
    return "packed", (
        f"{how}; a group switches to one row per completion when packing costs more "
        "(long completions)"
    )


@dataclass(frozen=True)
class ScoringCost:
    """Model FLOPs of a forward, per position (the projections and MLP) and per query-key pair
    (attention scores and their weighted sum), from the model's config."""

    position: float
    pair: float

    @staticmethod
    def of(config) -> ScoringCost:
        h = config.hidden_size
        mlp = getattr(config, "intermediate_size", 4 * h)
        layers = config.num_hidden_layers
        return ScoringCost(position=2.0 * layers * (4 * h * h + 3 * h * mlp), pair=4.0 * layers * h)

    def packing_pays(self, prompt_len: int, completion_lens: list[int]) -> bool:
        """One packed sequence (the prompt once, then every completion; its attention covers
        the whole square, the mask does not skip work) against one row per completion (the
        prompt repeated, padded to the longest completion, causal attention: half the square).
        The packed mask also costs memory quadratic in the group's length; this rule stops
        packing long before that matters, since the square is what makes it slower."""
        packed = prompt_len + sum(max(n - 1, 0) for n in completion_lens)
        row = prompt_len + max(completion_lens)
        packed_cost = self.position * packed + self.pair * packed * packed
        rows_cost = len(completion_lens) * (self.position * row + self.pair * row * row / 2)
        return packed_cost <= rows_cost


def packed_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    sampling: Sampling | float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs`` with every row packed by prompt (see ``pack``)."""
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask)
    config = _config(model)
    implementation = getattr(config, "_attn_implementation", None)
    inputs = {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "logits_to_keep": packed.keep,
        "use_cache": False,
    }
    if implementation == PREFIX and not attention_dropout_on(model):
        # no [L, L] mask: the layout says what each token reads (grpo.prefix_attention). The
        # mask of ones keeps transformers from building one: given none, it reads packed
        # sequences from the restarting position ids and builds their block mask, [U, L, L]
        layout = prefix_layout(packed.segment)
        mask = torch.ones_like(packed.input_ids)
        out = model(**inputs, attention_mask=mask, prefix_layout=layout)
        if not layout.uses[0]:
            raise RuntimeError(
                f"{type(model).__name__} does not pass keyword arguments to its attention, so "
                "packed scoring cannot use prefix attention: load it with attn_implementation='sdpa'"
            )
    else:
        dtype = PACKABLE[implementation] or next(model.parameters()).dtype
        out = model(**inputs, attention_mask=packed.attention_mask(dtype))
    logits = out.logits.reshape(-1, out.logits.shape[-1])  # [U * keep, V]
    history = History(prompt_ids, prompt_mask, completion_ids, completion_mask)
    return token_logprobs(
        logits, packed.at, completion_ids, sampling, with_entropy, history=history
    )


def group_rows_logprobs(
    model: nn.Module,
    prompt: Tensor,
    completion_ids: Tensor,
    lengths: Tensor,
    sampling: Sampling | float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One group's completions as one row each, its prompt repeated, without an attention mask.

    prompt: [S] the group's real prompt tokens; completion_ids: [g, T] right padded; lengths:
    [g]. Every row starts with the same unpadded prompt and is padded only after its last real
    token, so plain causal attention is exact for every real token and no [L, L] mask is ever
    built: memory grows linearly with the tokens scored. Returns logp [g, t] (t = the longest
    completion) and entropy.
    """
    g, t = completion_ids.shape[0], max(int(lengths.max()), 1)
    ids = torch.cat([prompt.expand(g, -1), completion_ids[:, :t]], dim=1)  # [g, S + t]
    out = model(input_ids=ids, logits_to_keep=t + 1, use_cache=False)
    logits = out.logits[:, :-1].reshape(g * t, -1)  # position S-1+j predicts completion token j
    at = torch.arange(g * t, device=logits.device).view(g, t)
    completion_mask = torch.arange(t, device=ids.device)[None, :] < lengths[:, None]  # [g, t]
    prompt_mask = torch.ones(g, len(prompt), dtype=torch.bool, device=ids.device)
    history = History(prompt.expand(g, -1), prompt_mask, completion_ids[:, :t], completion_mask)
    return token_logprobs(
        logits, at, completion_ids[:, :t], sampling, with_entropy, history=history
    )


def attention_dropout_on(model: nn.Module) -> bool:
    """Whether a forward of ``model`` now drops attention weights: in training, with a rate left
    on where HF attention layers keep it, as a float (``attention_dropout``: Llama, Qwen) or as
    a module named for attention (``attn_dropout``: GPT-2). Read from the modules, not the
    config: ``models.disable_dropout`` zeroes the modules and leaves the config as it was."""
    if not model.training:
        return False
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            attention = any(word in name.rpartition(".")[2] for word in ("attn", "attention"))
            rate = module.p if attention else 0.0
        else:
            rate = getattr(module, "attention_dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            return True
    return False


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
