"""Per-token log-probs (and entropy) of completion tokens only: the scoring entry points.

``completion_logprobs`` scores a micro-batch: rows that share a prompt are packed into one
sequence (``grpo.scoring.packing``) while that costs less than one row per completion, other
groups get one unmasked row per completion (``group_rows_logprobs``), and models that cannot take
the packed mask one padded row per completion (``full_sequence_logprobs``); ``scoring_path`` says
which. Every path scores through the chunked LM head (``grpo.scoring.chunked_head``). Logits go
through the decoding controls the engine used (temperature, and when set repetition penalty,
min-p, top-k, top-p: ``grpo.scoring.distribution``), so the log-probs are those of the
distribution the tokens were sampled from.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from grpo.scoring.chunked_head import CHUNK, History, Scorer, _scores
from grpo.scoring.distribution import Decoding
from grpo.scoring.packing import PACKABLE, ScoringCost, _config, packed_logprobs
from grpo.scoring.prefix_attention import PREFIX


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as `generate` computes them: [B, L] -> [B, L]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def token_logprobs(
    logits: Tensor,
    at: Tensor,
    targets: Tensor,
    decoding: Decoding | float = 1.0,
    with_entropy: bool = False,
    chunk: int = CHUNK,
    history: History | None = None,
) -> tuple[Tensor, Tensor | None]:
    """logits: [M, V] positions; at: [B, T] the position whose logits predict targets [B, T]
    -> log p(target) [B, T] float32, entropy [B, T] or None.

    ``decoding`` (or a bare temperature) says which distribution: the one the engine sampled
    from (``grpo.scoring.distribution``). The log-normaliser of each position is taken ``chunk`` positions
    at a time, so the float32 temporaries stay small; a position shared by several targets (a
    prompt's last token predicts every completion's first) is normalised once.
    """
    scorer = Scorer.of(at, targets, decoding, with_entropy, history, logits.shape[0])
    return scorer.of_logits(logits, chunk)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    decoding: Decoding | float = 1.0,
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
    split = packing_groups(model, prompt_ids, prompt_mask, completion_mask)
    if split is None:
        return full_sequence_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            decoding,
            with_entropy,
        )
    packed_rows, row_groups = split
    lengths = completion_mask.sum(dim=1)
    parts: list[tuple[Tensor, tuple[Tensor, Tensor | None]]] = []
    if packed_rows:
        rows = torch.cat(packed_rows)
        every = len(rows) == len(prompt_ids)
        ids, pm, cids, cm = (
            (prompt_ids, prompt_mask, completion_ids, completion_mask)
            if every
            else (prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows])
        )
        result = packed_logprobs(model, ids, pm, cids, cm, decoding, with_entropy)
        if every:
            return result
        parts.append((rows, result))
    for rows, prompt in row_groups:
        result = group_rows_logprobs(
            model, prompt, completion_ids[rows], lengths[rows], decoding, with_entropy
        )
        parts.append((rows, result))
    return _merge(parts, completion_ids.shape[1], with_entropy)


def packing_groups(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_mask: Tensor
) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]] | None:
    """How a batch is scored: None for one padded row per completion (attention that takes no
    custom mask, or a sliding window the sequences outgrow); else the row indices of the groups
    packed by prompt, and (rows, unpadded prompt) of the groups whose packing costs more than
    one row per completion (``ScoringCost.packing_pays``). Shared by the policy's scoring and
    the critic's values."""
    if scoring_path(model)[0] != "packed" or not fits_window(model, prompt_mask, completion_mask):
        return None
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
    return packed_rows, row_groups


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


def sliding_window(model: nn.Module) -> int | None:
    """The model's attention window, when some of its layers slide one (Gemma 3: 512)."""
    config = _config(model)
    window = getattr(config, "sliding_window", None)
    return window if window and getattr(config, "use_sliding_window", True) else None


def fits_window(model: nn.Module, prompt_mask: Tensor, completion_mask: Tensor) -> bool:
    """Whether every sequence of the batch, prompt and completion, fits in the model's sliding
    window (or it has none): a window that long excludes no key, its layers are plain causal
    attention, and the packed layouts (which replace the model's own masks) are exact."""
    window = sliding_window(model)
    if window is None:
        return True
    longest = int(prompt_mask.sum(dim=1).max()) + int(completion_mask.sum(dim=1).max())
    return longest <= window


def scoring_path(model: nn.Module) -> tuple[str, str]:
    """("packed" | "rows", why): how ``completion_logprobs`` scores this model's completions."""
    implementation = getattr(_config(model), "_attn_implementation", None)
    if implementation not in PACKABLE:
        return "rows", f"{implementation} attention takes no custom mask"
    how = (
        "prefix attention: each completion reads its prompt and its own tokens, no [L, L] mask"
        if implementation == PREFIX
        else f"{implementation} attention takes a custom mask"
    )
    window = sliding_window(model)
    if window is not None:
        # the packed layout replaces the model's masks, its sliding window included: exact only
        # while no sequence outgrows the window
        how += (
            f"; with a sliding window of {window}: packed while every sequence of a batch fits "
            "in it, else one padded row per completion"
        )
    return "packed", (
        f"{how}; a group switches to one row per completion when packing costs more "
        "(long completions)"
    )


def group_rows_logprobs(
    model: nn.Module,
    prompt: Tensor,
    completion_ids: Tensor,
    lengths: Tensor,
    decoding: Decoding | float = 1.0,
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
    completion_mask = torch.arange(t, device=ids.device)[None, :] < lengths[:, None]  # [g, t]
    prompt_mask = torch.ones(g, len(prompt), dtype=torch.bool, device=ids.device)
    history = History(prompt.expand(g, -1), prompt_mask, completion_ids[:, :t], completion_mask)
    at = _row_positions(g, t, ids.device)
    scorer = Scorer.of(at, completion_ids[:, :t], decoding, with_entropy, history, g * (t + 1))
    return _scores(model, scorer, input_ids=ids, logits_to_keep=t + 1, use_cache=False)


def _row_positions(b: int, t: int, device: torch.device) -> Tensor:
    """[b, t]: of each row's t + 1 kept positions (S-1 .. S+T-1), position S-1+j predicts
    completion token j; the last one predicts past the end and is not read."""
    return torch.arange(b * (t + 1), device=device).view(b, t + 1)[:, :t]


def full_sequence_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    decoding: Decoding | float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs`` as one forward over prompt + completion of every row."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, S+T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    b, t = completion_ids.shape
    history = History(prompt_ids, prompt_mask, completion_ids, completion_mask)
    at = _row_positions(b, t, input_ids.device)
    scorer = Scorer.of(at, completion_ids, decoding, with_entropy, history, b * (t + 1))
    return _scores(
        model,
        scorer,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=t + 1,  # positions S-1 .. S+T-1
        use_cache=False,
    )
