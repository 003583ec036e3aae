"""Attention for packed groups that skips the masked-out square.

A packed group (``packing.Packed``) is its prompt once, then every completion. Under the dense
[L, L] mask, SDPA still computes every query-key pair, though a completion only reads the prompt
and its own earlier tokens: at G = 8 and completions of the prompt's length, about four fifths of
the square is masked out. Here each completion attends as its own short row, its prompt's keys
followed by its own, and the prompt attends to itself: the same values (up to float rounding)
for a fraction of the pairs, and no [L, L] mask. The projections and MLPs still see each prompt
token once, which is what packing is for.

The model runs the registered implementation ``PREFIX`` (``use_prefix_attention``): a forward
given ``prefix_layout=PrefixLayout`` (``packing.packed_logprobs``) takes this path; every other
forward (generation, plain rows) is SDPA's, unchanged. The layout travels as a keyword argument,
so a recomputation under gradient checkpointing takes the same path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

PREFIX = "grpo_prefix"


@dataclass
class PrefixLayout:
    """Where each token of a packed batch reads from, as indices into its U * L positions.

    Prompt u's tokens attend causally to prompt u; completion r's tokens attend to all of its
    prompt and causally to its own earlier tokens. Padding slots of the index tensors point at
    position 0 and are blocked as keys; a padding query slot still sees its prompt (every prompt
    has a token), so no softmax row is empty (an empty one is NaN, and so is its gradient).
    """

    prompt_at: Tensor  # [U, P] positions of each prompt, padded
    prompt_blocked: Tensor  # [U, 1, P, P] True where a prompt token may not attend
    rows_query: Tensor  # [R, N] positions of each completion's tokens, padded
    rows_key: Tensor  # [R, P + N] its prompt's positions, then its own
    rows_blocked: Tensor  # [R, 1, N, P + N]
    # [U * L] each position's row in the attention's outputs laid end to end (the prompts'
    # [U, P] slots, then the completions' [R, N], then one row of zeros that padding reads)
    source: Tensor
    uses: list[int] = field(default_factory=lambda: [0])  # attention calls that took this path
    # the longest sequence packed, prompt and completion, in positions: a sliding window at
    # least this long excludes no key, so its layer is plain causal attention (Gemma 3)
    span: int = 0


# ``Packed.group`` of the leading prompt tokens every group shares (packed once, end to end)
SHARED = -2


def prefix_layout(segment: Tensor, group: Tensor) -> PrefixLayout:
    """The layout of packed sequences from ``Packed.segment`` and ``Packed.group`` ([U, L]: 0
    a prompt, k its group's k-th completion, -1 padding; and the group, -1 padding, ``SHARED``
    on leading prompt tokens that every group's prompt starts with)."""
    segment, group = segment.flatten(), group.flatten()
    device = segment.device
    flat = torch.arange(segment.numel(), device=device)
    shared = group == SHARED
    members = [group == u for u in range(int(group.max()) + 1)]
    prompts = [flat[(ours | shared) & (segment == 0)] for ours in members]
    rows = [
        (u, flat[ours & (segment == k)])
        for u, ours in enumerate(members)
        for k in range(1, int(segment[ours].max()) + 1)
    ]
    p = max(len(x) for x in prompts)
    n = max((len(x) for _, x in rows), default=1)
    prompt_at, prompt_real = _padded(prompts, p, device)
    rows_query, query_real = _padded([x for _, x in rows], n, device)
    rows_key, key_real = _padded(
        [torch.cat([prompt_at[u][prompt_real[u]], x]) for u, x in rows], p + n, device
    )
    # a completion's key j is its prompt's (j < P_u) or its own token j - P_u, seen up to itself
    own_start = prompt_real.sum(dim=1)[[u for u, _ in rows]] if rows else torch.zeros(0)
    i = torch.arange(n, device=device)[None, :, None]
    j = torch.arange(p + n, device=device)[None, None, :]
    start = own_start.to(device)[:, None, None]
    rows_allowed = key_real[:, None, :] & ((j < start) | (j - start <= i))
    causal = torch.ones(p, p, dtype=torch.bool, device=device).tril()
    prompt_allowed = causal[None] & prompt_real[:, None, :]
    # the shared tokens are every prompt's keys but the first prompt's queries alone: each is
    # written back once, and its gradient counted once
    prompt_query = prompt_real.clone()
    prompt_query[1:, : int(shared.sum())] = False
    target = torch.cat([prompt_at[prompt_query], rows_query[query_real]])
    slots = torch.cat([prompt_query.flatten(), query_real.flatten()]).nonzero().flatten()
    source = torch.full_like(flat, prompt_query.numel() + query_real.numel())
    source[target] = slots
    return PrefixLayout(
        prompt_at, ~prompt_allowed[:, None], rows_query, rows_key, ~rows_allowed[:, None], source
    )


def _padded(parts: list[Tensor], width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Index lists as one [len(parts), width] tensor padded with 0, and where they are real."""
    at = torch.zeros(len(parts), width, dtype=torch.long, device=device)
    real = torch.zeros(len(parts), width, dtype=torch.bool, device=device)
    for r, x in enumerate(parts):
        at[r, : len(x)] = x
        real[r, : len(x)] = True
    return at, real


def _gather(x: Tensor, at: Tensor) -> Tensor:
    """Rows ``at`` ([B, n]) of x ([U * L, H, D]) as [B, n, H, D]; index_select's backward is a
    plain index_add (advanced indexing's accumulates through a sort)."""
    return x.index_select(0, at.flatten()).view(*at.shape, *x.shape[1:])


def in_float32(q: Tensor) -> bool:
    """Whether attention runs in float32 whatever autocast says: on a CPU, where SDPA's kernel
    is faster in float32 than in bf16 at packed shapes, forward and backward (1.06-3x on both
    CPU kinds measured: docs/results/levers.md), and more exact. Elsewhere (a GPU's flash
    kernel) it runs as autocast decides."""
    return q.device.type == "cpu"


def _attend(q: Tensor, k: Tensor, v: Tensor, blocked: Tensor, scale: float) -> Tensor:
    """Softmax attention through SDPA's kernel, which keeps no scores for backward (``in_float32``
    on a CPU: a float32 model's numbers unchanged). q: [B, n, Hq, D]; k, v: [B, m, Hkv, D];
    blocked: [B, 1, n, m] (True = may not attend). Returns [B, n, Hq, D]; query heads share
    their key head in groups (GQA).

    Explicit scores with a float32 softmax (before this kernel took every row) were as fast in
    the reference forward and 1.08x slower in the update on a memory-bound Xeon
    (docs/results/levers.md), and backward kept them."""
    exact = in_float32(q)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, n or m, D]
    hq, hkv = q.shape[1], k.shape[1]
    # CPU autocast runs SDPA in bf16, whatever its inputs
    with torch.autocast(q.device.type, enabled=False) if exact else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(
            *(t.float() if exact else t for t in (q, k, v)),
            attn_mask=~blocked,
            scale=scale,
            enable_gqa=hq != hkv,
        )
    return out.transpose(1, 2).to(q.dtype) if exact else out.transpose(1, 2)


def prefix_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    prefix_layout: PrefixLayout | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """An ``AttentionInterface`` function: SDPA's, or with ``prefix_layout`` the packed groups'
    attention above. query: [U, Hq, L, D]; key, value: [U, Hkv, L, D]; returns [U, L, Hq, D]."""
    if prefix_layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    window = kwargs.get("sliding_window")
    if dropout or kwargs.get("softcap") is not None or (window and prefix_layout.span > window):
        # packed_logprobs passes no layout to such models or batches; reaching here is a bug
        raise ValueError(
            "prefix attention: plain softmax attention only (no dropout, softcap, or a "
            "sliding window shorter than the sequences)"
        )
    u, hq, length, d = query.shape
    scale = scaling if scaling is not None else d**-0.5
    q, k, v = (t.transpose(1, 2).reshape(u * length, t.shape[1], d) for t in (query, key, value))
    lay = prefix_layout
    at, rows_q, rows_k = lay.prompt_at, lay.rows_query, lay.rows_key
    prompts = _attend(_gather(q, at), _gather(k, at), _gather(v, at), lay.prompt_blocked, scale)
    rows = _attend(
        _gather(q, rows_q), _gather(k, rows_k), _gather(v, rows_k), lay.rows_blocked, scale
    )
    lay.uses[0] += 1
    return write_back(prompts, rows, lay).view(u, length, hq, d), None


def write_back(prompts: Tensor, rows: Tensor, lay: PrefixLayout) -> Tensor:
    """The attention's outputs ([U, P, H, D] prompts', [R, N, H, D] completions') at the packed
    positions ([U * L, H, D]), zeros at padding. Every position reads its row by index:
    index_select's backward is a plain index_add, where a boolean selection's accumulates
    through a sort (docs/results/levers.md; under ``torch.use_deterministic_algorithms`` CUDA
    sorts for both). Each row is read by one position at most, so the gradients are the
    selection's bit for bit. The zeros take the outputs' dtype (bf16 under CUDA autocast,
    whatever the queries')."""
    zeros = prompts.new_zeros(1, *prompts.shape[2:])
    return torch.cat([prompts.flatten(0, 1), rows.flatten(0, 1), zeros]).index_select(0, lay.source)


def use_prefix_attention(model: nn.Module) -> bool:
    """Switch a model on SDPA attention to ``PREFIX`` (SDPA except on packed groups); False, and
    nothing changes, for other implementations or models that cannot switch."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    can = getattr(type(model), "_can_set_attn_implementation", None)
    if can is None or not can():
        return False
    model.set_attn_implementation(PREFIX)
    return True


AttentionInterface.register(PREFIX, prefix_attention_forward)
# masks as SDPA's for every forward that is not a packed group's (generation's padding, rows)
ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX, sdpa_mask)
