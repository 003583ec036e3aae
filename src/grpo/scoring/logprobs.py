"""Per-token log-probs (and entropy) of completion tokens only.

Completions that share a prompt (a group's G samples) are packed into one sequence: the prompt
once, then each completion, each completion seeing the prompt and its own earlier tokens, nothing
else. A group then costs one prompt forward (and backward) instead of G, and no position is spent
on padding. Models the trainer loads attend with ``grpo.scoring.prefix_attention``: each completion as a
short row over its prompt, no mask; others take a dense [L, L] mask (a group of L tokens), whose
attention covers the whole square. Either way, for long completions a cost rule
(``ScoringCost.packing_pays``, priced for the square, so conservative for prefix attention) gives
the group one row per completion instead: the prompt repeated, no mask at all (plain causal
attention), memory linear in the tokens scored. The LM
head runs only on the positions that predict completion tokens (``logits_to_keep``), and it runs
a chunk of positions at a time together with the log-normaliser, recomputed in backward
(``_ChunkedHead``; under temperature-only sampling in one float32 buffer, in place), so
neither the [positions, vocab] logits nor their gradient ever exists whole; models whose head is no plain linear layer, or that change its output, get the
full logits, normalised a chunk at a time. Logits go through the sampling controls the
engine used (temperature, and when set repetition penalty, min-p, top-k, top-p:
``grpo.scoring.distribution``), so the log-probs are those of the distribution the tokens were sampled
from.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from grpo.scoring.distribution import Sampling, seen_tokens, shape_logits, truncate
from grpo.scoring.prefix_attention import PREFIX, SHARED, prefix_layout

# attention implementations that take a custom 4D mask (others get one full sequence per row);
# PREFIX takes a packed layout instead, and the mask only when it cannot (attention dropout)
PACKABLE = {"sdpa": torch.bool, "eager": None, PREFIX: torch.bool}

# positions whose log-normaliser (and, chunked, whose LM head) is computed at once: [64, V]
# float32 is 12 MiB on SmolLM2 (V = 49152), under the heap's 16 MiB mmap threshold
CHUNK = 64

# the chunked head under plain sampling (temperature only: ``Sampling.plain``) works in one
# float32 [rows, V] buffer per forward and per backward, overwritten in place, so it takes
# more positions at a time: each chunk reads the whole head weight once per product, and at
# 64 rows SmolLM2's head products ran at 204-268 GFLOP/s against 259-339 at 128-384 rows on
# the Xeon of README's Performance (one-off probe)
PLAIN_CHUNK_BYTES = 32 << 20

# rows of a [rows, V] float32 temporary per step of the in-place entropy (4 MiB)
ENTROPY_BLOCK_BYTES = 4 << 20

# bytes of one block of the head's weight gradient made by one product in a lower precision:
# its result and oneDNN's float32 accumulator (6 bytes a value) stay under ``train.malloc:
# keep``'s 16 MiB mmap threshold, so they reuse heap memory rather than come as fresh pages
PRODUCT_BLOCK_BYTES = 8 << 20


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as `generate` computes them: [B, L] -> [B, L]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def token_logprobs(
    logits: Tensor,
    at: Tensor,
    targets: Tensor,
    sampling: Sampling | float = 1.0,
    with_entropy: bool = False,
    chunk: int = CHUNK,
    history: History | None = None,
) -> tuple[Tensor, Tensor | None]:
    """logits: [M, V] positions; at: [B, T] the position whose logits predict targets [B, T]
    -> log p(target) [B, T] float32, entropy [B, T] or None.

    ``sampling`` (or a bare temperature) says which distribution: the one the engine sampled
    from (``grpo.scoring.distribution``). The log-normaliser of each position is taken ``chunk`` positions
    at a time, so the float32 temporaries stay small; a position shared by several targets (a
    prompt's last token predicts every completion's first) is normalised once.
    """
    scorer = Scorer.of(at, targets, sampling, with_entropy, history, logits.shape[0])
    return scorer.of_logits(logits, chunk)


def add_product_(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` ([V, c] @ [c, H] into [V, H]).

    float32 operands, or any device but the CPU: one ``addmm_`` in ``out``'s dtype, no
    temporary. bf16 operands on the CPU (under autocast): one product per block of ``out``'s
    rows, each added into ``out``; a single product would make [V, H] temporaries (its float32
    accumulator, its result: 162 MiB on SmolLM2 by arithmetic) that come as fresh pages every
    chunk. Each block of each chunk is rounded to bf16 once before it is added: a rounding per
    64-row chunk, where autocast rounds a layer's weight gradient once per product.
    """
    if a.dtype == torch.float32 or out.device.type != "cpu":
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
        return
    rows = max(1, PRODUCT_BLOCK_BYTES // (6 * b.shape[1]))
    for lo in range(0, out.shape[0], rows):
        out[lo : lo + rows].add_(a[lo : lo + rows] @ b)


def _logits_buffer(hidden: Tensor, weight: Tensor, chunk: int) -> Tensor:
    """The float32 [chunk, V] buffer the plain chunked head computes each chunk's logits in."""
    rows = min(chunk, hidden.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=torch.float32, device=hidden.device)


def _logits_into(buffer: Tensor, h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """The logits of hidden states ``h`` [c, H] under head ``w``, ``b``, in ``buffer[:c]``: the
    product writes there when it runs in float32, else its result is copied in."""
    out = buffer[: h.shape[0]]
    if w.dtype != out.dtype:
        return out.copy_(F.linear(h.to(w.dtype), w, b))
    h = h.to(w.dtype)
    return torch.mm(h, w.T, out=out) if b is None else torch.addmm(b, h, w.T, out=out)


def _cat(parts: list[Tensor | None]) -> Tensor | None:
    return None if parts[0] is None else torch.cat(parts)


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


@dataclass
class Scorer:
    """What a micro-batch's log-probs need from each chunk of its logits, and how the chunks'
    terms make them: the target tokens grouped by the position that predicts them, so a chunk
    of positions holds a contiguous run of targets.

    Under penalty and truncation (``grpo.scoring.distribution``), a target the truncation removed
    (possible only when the trainer's numbers differ from the sampler's) is scored as if its
    position's kept set included it, so its log-prob stays finite.
    """

    at: Tensor  # [B, T] the position whose logits predict each target
    order: Tensor  # [B*T] targets sorted by position; any order within a position will do,
    sorted_at: Tensor  # since each value is put back in its place by the inverse permutation
    tokens: Tensor  # [B*T] the target tokens, in ``order``
    sampling: Sampling
    with_entropy: bool
    history: History | None
    owners: tuple[Tensor, Tensor] | None  # per position, a row and index it predicts for

    @staticmethod
    def of(
        at: Tensor,
        targets: Tensor,
        sampling: Sampling | float,
        with_entropy: bool,
        history: History | None,
        positions: int,
    ) -> Scorer:
        if not isinstance(sampling, Sampling):
            sampling = Sampling(temperature=sampling)
        flat_at = at.flatten()
        order = torch.argsort(flat_at)
        owners = None
        if sampling.repetition_penalty != 1.0:
            if history is None:
                raise ValueError("repetition_penalty needs each row's history to score")
            owners = history.owners(at, positions)
        return Scorer(
            at,
            order,
            flat_at[order],
            targets.flatten()[order],
            sampling,
            with_entropy,
            history,
            owners,
        )

    def spans(self, positions: int, chunk: int) -> list[tuple[int, int]]:
        """Per chunk of ``chunk`` positions, the run [lo, hi) of (sorted) targets its positions
        predict; read back in one go (on a GPU, one host sync per forward, not one per chunk)."""
        # as many as ``split(chunk)`` makes: one, empty, for no positions
        edges = torch.tensor([*range(0, max(positions, 1), chunk), positions])
        bounds = torch.searchsorted(self.sorted_at, edges.to(self.sorted_at.device)).tolist()
        return list(itertools.pairwise(bounds))

    def terms(
        self, part: Tensor, start: int, span: tuple[int, int], with_entropy: bool | None = None
    ) -> Terms:
        """Logits of positions start .. start + c ([c, V]) and the run of targets they predict
        (``spans``) -> those targets' (shaped) logits, the log-normaliser [c], the truncation
        cutoff [c] (or None) and the entropy [c] (or None)."""
        stop = start + part.shape[0]
        seen = None
        if self.owners is not None and self.history is not None:
            rows, index = self.owners[0][start:stop], self.owners[1][start:stop]
            h = self.history
            seen = seen_tokens(
                h.prompt_ids[rows],
                h.prompt_mask[rows],
                h.completion_ids[rows],
                index,
                part.shape[1],
            )
        # float32 is a view of float32 logits; at temperature 1 nothing else copies [c, V]
        shaped = shape_logits(part.float(), self.sampling, seen)
        lo, hi = span
        picked = shaped[self.sorted_at[lo:hi] - start, self.tokens[lo:hi]]
        kept, cutoff = truncate(shaped, self.sampling)
        lse = torch.logsumexp(kept, dim=-1)
        entropy = None
        if self.with_entropy if with_entropy is None else with_entropy:
            with torch.no_grad():  # logged and used for token selection, never differentiated
                probs = torch.softmax(kept, dim=-1)  # 0 on removed tokens
                # -sum p ln p as sum p (lse - x): no logarithm per logit (5x faster than entr)
                # and no cancellation between two large sums, each term >= 0. nansum drops
                # the 0 * inf of a removed or -inf logit; lse - lse (NaN where lse is not
                # finite: a NaN or +inf logit, or every logit -inf) keeps such a row NaN
                terms = (lse[:, None] - kept).mul_(probs)  # one [c, V] temporary, not two
                entropy = terms.nansum(dim=-1) + (lse - lse)
        return picked, lse, cutoff, entropy

    def head_chunk(self, positions: int, vocab: int) -> int:
        """Positions per chunk of the chunked head: ``CHUNK``, or under plain sampling as many
        as fit ``PLAIN_CHUNK_BYTES`` of float32 logits, spread evenly over the chunks (a ragged
        last chunk would read the whole weight for a few rows)."""
        if not self.sampling.plain:
            return CHUNK
        most = max(1, PLAIN_CHUNK_BYTES // (4 * vocab))
        count = -(-max(positions, 1) // most)
        return -(-max(positions, 1) // count)

    def plain_terms_(
        self, logits: Tensor, start: int, span: tuple[int, int], keep: bool = False
    ) -> Terms:
        """``terms`` under plain sampling, computed in ``logits`` ([c, V] float32, overwritten):
        no [c, V] temporary but a few rows at a time for the entropy. ``keep``: leave the
        log-softmax x / T - lse in ``logits``, from which ``softmax_grad_`` makes the gradient
        without the logits again."""
        if self.sampling.temperature != 1.0:
            logits.div_(self.sampling.temperature)  # as ``shape_logits`` divides
        lo, hi = span
        picked = logits[self.sorted_at[lo:hi] - start, self.tokens[lo:hi]]
        top = logits.amax(dim=-1, keepdim=True)
        shifted = logits.sub_(top)  # x - max: every exp <= 1
        if not (self.with_entropy or keep):
            total = shifted.exp_().sum(dim=-1)
            return picked, top.squeeze(-1) + total.log(), None, None
        # entropy = lse - sum p x = log(total) - sum e (x - max) / total, e = exp(x - max); e
        # and x - max are both needed, so e is made a few rows at a time
        total = torch.empty_like(top.squeeze(-1))
        moment = torch.empty_like(total)
        rows = max(1, ENTROPY_BLOCK_BYTES // (4 * logits.shape[1]))
        for r in range(0, logits.shape[0], rows):
            part = shifted[r : r + rows]
            e = part.exp()
            total[r : r + rows] = e.sum(dim=-1)
            if self.with_entropy:
                # nansum: a removed or -inf logit's 0 * -inf adds nothing, as in ``terms``
                moment[r : r + rows] = e.mul_(part).nansum(dim=-1)
        log_total = total.log()
        if keep:
            shifted.sub_(log_total[:, None])
        entropy = log_total - moment / total if self.with_entropy else None
        return picked, top.squeeze(-1) + log_total, None, entropy

    def plain_grad_(
        self,
        logits: Tensor,
        start: int,
        span: tuple[int, int],
        lse: Tensor,
        grad_picked: Tensor,
        grad_lse: Tensor,
    ) -> Tensor:
        """The gradient of the raw ``logits`` ([c, V] float32) from those of ``plain_terms_``'s
        picked logits and log-normaliser, computed in ``logits`` (overwritten, returned)."""
        if self.sampling.temperature != 1.0:
            logits.div_(self.sampling.temperature)
        return self.softmax_grad_(logits.sub_(lse[:, None]), start, span, grad_picked, grad_lse)

    def softmax_grad_(
        self,
        log_softmax: Tensor,
        start: int,
        span: tuple[int, int],
        grad_picked: Tensor,
        grad_lse: Tensor,
    ) -> Tensor:
        """``plain_grad_`` from the log-softmax x / T - lse of the chunk's positions, in place:
        softmax * grad_lse, plus grad_picked at each target, over the temperature."""
        grad = log_softmax.exp_().mul_(grad_lse[:, None])
        lo, hi = span
        # accumulate: a position shared by several targets (a prompt's last) takes each one's
        grad.index_put_(
            (self.sorted_at[lo:hi] - start, self.tokens[lo:hi]), grad_picked, accumulate=True
        )
        temperature = self.sampling.temperature
        return grad.div_(temperature) if temperature != 1.0 else grad

    def of_logits(self, logits: Tensor, chunk: int = CHUNK) -> tuple[Tensor, Tensor | None]:
        """``logprobs`` of the terms of [M, V] logits, ``chunk`` positions at a time."""
        # one split, not a slice per chunk: a slice's backward writes its gradient into a zero
        # tensor of the whole [M, V] logits, so slicing cost O(M^2 V / chunk) in backward
        # (larger micro-batches were slower per token); split's backward concatenates once
        spans = self.spans(logits.shape[0], chunk)
        parts = enumerate(zip(logits.split(chunk), spans, strict=True))
        terms = [self.terms(part, k * chunk, span) for k, (part, span) in parts]
        return self.logprobs(*(_cat([t[i] for t in terms]) for i in range(4)))

    def logprobs(
        self, picked: Tensor, lse: Tensor, cutoff: Tensor | None, entropy: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Every chunk's terms, concatenated -> log p(target) [B, T], entropy [B, T] or None."""
        target = picked[torch.argsort(self.order)].view(self.at.shape)
        norm = lse[self.at]
        if cutoff is not None:
            outside = target.detach() < cutoff[self.at]
            norm = torch.where(outside, torch.logaddexp(norm, target), norm)
        return target - norm, entropy[self.at] if entropy is not None else None


# a chunk's picked logits, log-normaliser, cutoff and entropy
Terms = tuple[Tensor, Tensor, Tensor | None, Tensor | None]


class _ChunkedHead(torch.autograd.Function):
    """The LM head and a ``Scorer``'s terms, ``chunk`` positions at a time: hidden [M, H] ->
    picked [B*T] and log-normaliser [M], differentiable; the cutoff and entropy go to ``out``.

    Only the hidden states are kept for backward: each chunk's logits are computed again there
    and their gradient folded into the head's at once, so neither the [M, V] logits nor their
    gradient ever exists (a float32 [350, 49152] is 66 MiB on SmolLM2, per tensor). The
    recomputation costs one more head forward (a third of the head's update FLOPs). Under
    plain sampling each pass makes one float32 [chunk, V] buffer and does all of a chunk's work
    in it (``Scorer.plain_terms_``, ``Scorer.plain_grad_``), so its chunks are larger
    (``Scorer.head_chunk``); other samplings go through autograd, ``CHUNK`` positions a chunk.

    ``keep`` (plain sampling, ``full_logits``): one product computes every position's logits in
    one [M, V] buffer, the chunks' terms are taken in it in place, and it is kept for backward
    holding the log-softmax, which becomes the logits' gradient in place: no recomputation, one
    product per pass, and no [M, V] tensor but the buffer (the model's own head under autograd
    keeps the logits and makes their gradient, a concatenation of it and a temporary per chunk).

    ``in_place``: add the head's gradient into the weight's ``.grad`` (made here at a step's
    first micro-batch) and give autograd none, instead of a second [V, H] tensor that autograd
    would add (on SmolLM2's tied embedding, 108 MiB at the update's peak; at a step's first
    micro-batch autograd would sum it with the lookup's rows into a third). Only for a model
    run as it is: DDP and FSDP2 reduce what autograd accumulates, so under them the gradient
    goes the usual way. (``loss.backward()`` then has it in ``.grad`` as usual;
    ``torch.autograd.grad`` over the weight would not see it, and nothing here calls that.)
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, scorer, chunk, out, in_place, keep, grad):  # type: ignore[override]
        device = hidden.device.type
        # the dtype the head's products run in: autocast's (bf16) where it is on, else the weight's
        on = torch.is_autocast_enabled(device)
        run = torch.get_autocast_dtype(device) if on else weight.dtype
        ctx.scorer, ctx.chunk, ctx.in_place = scorer, chunk, in_place
        ctx.spans = scorer.spans(hidden.shape[0], chunk)
        ctx.save_for_backward(hidden, weight, bias)
        # cast once, not per chunk (autocast caches no cast of a frozen weight, the reference's),
        # and kept for backward, which comes next (nothing runs between the two but the loss)
        # and drops it: ctx outlives backward for as long as the loss is referenced
        w, b = weight.to(run), None if bias is None else bias.to(run)
        ctx.run_weights = w, b
        ctx.kept = None
        if keep and not scorer.sampling.plain:  # its terms would be a temperature's alone
            raise ValueError("kept logits take plain sampling (temperature only)")
        if keep:  # one product, then each chunk's terms in place
            logits = _logits_into(_logits_buffer(hidden, weight, hidden.shape[0]), hidden, w, b)
            # grad: the caller's grad mode (under no_grad needs_input_grad still reads True
            # for a weight that takes gradients, and the buffer would be made ready for nothing)
            backward = grad and any(ctx.needs_input_grad[:3])
            parts = enumerate(zip(logits.split(chunk), ctx.spans, strict=True))
            terms = [scorer.plain_terms_(x, k * chunk, s, keep=backward) for k, (x, s) in parts]
            ctx.kept = logits if backward else None  # each position's log-softmax now
        else:
            parts = enumerate(zip(hidden.split(chunk), ctx.spans, strict=True))
            if scorer.sampling.plain:
                buffer = _logits_buffer(hidden, weight, chunk)
                terms = [
                    scorer.plain_terms_(_logits_into(buffer, h, w, b), k * chunk, s)
                    for k, (h, s) in parts
                ]
            else:
                terms = [scorer.terms(F.linear(h, w, b), k * chunk, s) for k, (h, s) in parts]
        out.extend([_cat([t[2] for t in terms]), _cat([t[3] for t in terms])])
        picked, lse = torch.cat([t[0] for t in terms]), torch.cat([t[1] for t in terms])
        # the backward's softmax on the in-place path, without a logsumexp; None: autograd's
        ctx.lse = lse.detach() if scorer.sampling.plain and not keep else None
        return picked, lse

    @staticmethod
    def backward(ctx, grad_picked, grad_lse):  # type: ignore[override]
        hidden, weight, bias = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # every row is written
        # only a leaf keeps a .grad: a weight computed from others (a parametrization) hands
        # its gradient on through autograd, or it would be lost
        into_grad = need_weight and ctx.in_place and weight.is_leaf
        if into_grad and weight.grad is None:  # a step's first micro-batch: .grad starts here
            weight.grad = torch.zeros_like(weight)
        grad_weight = (
            weight.grad if into_grad else torch.zeros_like(weight) if need_weight else None
        )
        grad_bias = torch.zeros_like(bias) if need_bias else None
        w = ctx.run_weights[0]
        for start, h, grad in _ChunkedHead.logit_grads(ctx, hidden, grad_picked, grad_lse):
            if grad_hidden is not None:
                grad_hidden[start : start + h.shape[0]] = grad @ w
            if grad_weight is not None:
                add_product_(grad_weight, grad.T, h)
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0, dtype=grad_bias.dtype)
        ctx.run_weights = None
        if into_grad:
            grad_weight = None  # already in weight.grad
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None

    @staticmethod
    def logit_grads(
        ctx, hidden: Tensor, grad_picked: Tensor, grad_lse: Tensor
    ) -> Iterator[tuple[int, Tensor, Tensor]]:
        """(first position, hidden states [c, H], gradient of their logits [c, V]), both in the
        forward's product dtype: every position at once from the kept log-softmax, else a
        chunk at a time from the logits computed again."""
        scorer, chunk = ctx.scorer, ctx.chunk
        w, b = ctx.run_weights  # the forward's, so its logits come back exactly
        if ctx.kept is not None:
            grad, ctx.kept = ctx.kept, None
            for k, ((lo, hi), part) in enumerate(zip(ctx.spans, grad.split(chunk), strict=True)):
                start = k * chunk
                stop = start + part.shape[0]
                scorer.softmax_grad_(
                    part, start, (lo, hi), grad_picked[lo:hi], grad_lse[start:stop]
                )
            grad = grad.to(w.dtype)  # a bf16 product's copy; float32's is the buffer itself
            yield 0, hidden.to(w.dtype), grad
            return
        buffer = None if ctx.lse is None else _logits_buffer(hidden, w, chunk)
        for k, (h, (lo, hi)) in enumerate(zip(hidden.split(chunk), ctx.spans, strict=True)):
            start, stop = k * chunk, k * chunk + h.shape[0]
            h = h.to(w.dtype)
            # an output the loss does not use gets zeros here, never None (materialized grads)
            if buffer is not None:
                grad = scorer.plain_grad_(
                    _logits_into(buffer, h, w, b),
                    start,
                    (lo, hi),
                    ctx.lse[start:stop],
                    grad_picked[lo:hi],
                    grad_lse[start:stop],
                ).to(w.dtype)  # [c, V]: the products run in the forward's dtype
            else:
                logits = F.linear(h, w, b).requires_grad_()  # the forward's logits, exactly
                with torch.enable_grad():
                    picked, lse, _, _ = scorer.terms(logits, start, (lo, hi), with_entropy=False)
                torch.autograd.backward((picked, lse), (grad_picked[lo:hi], grad_lse[start:stop]))
                grad = logits.grad  # [c, V]
            yield start, h, grad


class _ScoringHead(nn.Module):
    """Stands in for a model's ``nn.Linear`` LM head during one forward: runs ``_ChunkedHead``
    on the hidden states it is given and returns the differentiable terms as the "logits", so
    they leave the model through its output (where DDP and FSDP2 hook their backward)."""

    def __init__(self, head: nn.Linear, scorer: Scorer, in_place: bool, keep: bool) -> None:
        super().__init__()
        self.head, self.scorer, self.in_place, self.keep = head, scorer, in_place, keep
        self.extras: list[Tensor | None] = []  # cutoff and entropy, set by the forward
        self.output: Tensor | None = None
        self.positions = 0  # the forward's, for the caller to check against what it asked

    def forward(self, hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        w, b = self.head.weight, self.head.bias
        chunk = self.scorer.head_chunk(flat.shape[0], w.shape[0])
        args = (self.scorer, chunk, self.extras, self.in_place, self.keep, torch.is_grad_enabled())
        self.positions = flat.shape[0]
        picked, lse = _ChunkedHead.apply(flat, w, b, *args)
        self.output = torch.cat([picked, lse])[None, None]
        return self.output


@dataclass(frozen=True)
class _HeadSlot:
    """Where a model keeps its LM head: ``getattr(parent, name) is head``."""

    parent: nn.Module
    name: str
    head: nn.Linear

    @contextlib.contextmanager
    def holding(self, module: nn.Module) -> Iterator[None]:
        setattr(self.parent, self.name, module)
        try:
            yield
        finally:
            setattr(self.parent, self.name, self.head)


# LM heads whose logits are computed whole and kept for backward (``full_logits``)
_FULL_LOGITS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# LM heads whose model changes what they return (soft-capping, scaling): scored from the
# model's own logits, since the scoring head's terms are no logits to change
_OWN_LOGITS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def full_logits(model: nn.Module, on: bool = True) -> None:
    """Score ``model`` from its full logits from now on (``model.chunked_head: false``), or,
    with ``on=False``, a chunk at a time again where it can."""
    head = getattr(model, "module", model).get_output_embeddings()
    if head is not None and on:
        _FULL_LOGITS.add(head)
    elif head is not None:
        _FULL_LOGITS.discard(head)


def head_slot(model: nn.Module) -> _HeadSlot | None:
    """The LM head ``completion_logprobs`` puts its scoring head in place of, or None when it
    cannot: a head that is no plain ``nn.Linear`` (LoRA on the head, quantised), one no module
    holds, or one whose model was seen to post-process its output."""
    inner = getattr(model, "module", model)  # DDP keeps the model on .module
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head in _OWN_LOGITS:
        return None
    return next(
        (
            _HeadSlot(parent, name, head)
            for parent in inner.modules()
            for name, child in parent.named_children()
            if child is head
        ),
        None,
    )


def chunked_head_slot(model: nn.Module) -> _HeadSlot | None:
    """``head_slot`` where the head runs a chunk at a time (not asked for ``full_logits``)."""
    slot = head_slot(model)
    return None if slot is None or slot.head in _FULL_LOGITS else slot


def _runs_as_it_is(model: nn.Module) -> bool:
    """No DDP wrapper (``.module``) and no FSDP2 sharding: gradients go nowhere after ``.grad``."""
    from torch.distributed.fsdp import FSDPModule

    return not hasattr(model, "module") and not isinstance(model, FSDPModule)


@contextlib.contextmanager
def lookup_into_grad(model: nn.Module) -> Iterator[None]:
    """During a differentiated forward of a model run as it is, its input embedding's backward
    adds the looked-up rows into the weight's dense ``.grad`` (a sparse gradient, added in
    place), instead of handing autograd a dense [V, H] gradient of mostly zeros to add: 108 MiB
    at the update's peak on SmolLM2, more on larger vocabularies.

    Only where the sum stays dense: the weight already has a ``.grad`` (every micro-batch after
    a step's first), or it is tied to the LM head, whose dense gradient meets it in the same
    backward. Alone, a sparse gradient would become a sparse ``.grad``, which the optimizer and
    clipping do not take. DDP and FSDP2 reduce what autograd hands them, so not under them."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) and torch.is_grad_enabled() else None
    if type(emb) is not nn.Embedding or emb.sparse or not emb.weight.requires_grad:
        yield
        return
    head = getattr(model, "get_output_embeddings", lambda: None)()
    tied = head is not None and head.weight is emb.weight
    emb.sparse = (emb.weight.grad is not None or tied) and _runs_as_it_is(model)
    try:
        yield
    finally:
        emb.sparse = False


def _scores(model: nn.Module, scorer: Scorer, **inputs) -> tuple[Tensor, Tensor | None]:
    """One forward of ``model`` and the log-probs ``scorer`` makes of it: (logp, entropy). The
    scoring head stands in for the model's where ``head_slot`` allows it: a chunk at a time,
    or under plain sampling with ``full_logits`` every position at once, kept for backward."""
    with lookup_into_grad(model):
        return _forward_scores(model, scorer, **inputs)


def kept_positions(input_ids: Tensor, logits_to_keep: int | Tensor) -> int:
    """How many positions' logits a forward given ``logits_to_keep`` computes (0: all)."""
    rows, length = input_ids.shape
    if isinstance(logits_to_keep, Tensor):  # these positions of every sequence
        return rows * logits_to_keep.numel()
    return rows * (logits_to_keep if 0 < logits_to_keep < length else length)


def _check_positions(model: nn.Module, got: int, inputs: dict) -> None:
    """A model that ignores ``logits_to_keep`` would have its log-probs read off the wrong
    positions without a word: refuse it."""
    want = kept_positions(inputs["input_ids"], inputs.get("logits_to_keep", 0))
    if got != want:
        name = type(getattr(model, "module", model)).__name__
        raise RuntimeError(
            f"{name} computed {got} positions' logits where logits_to_keep asked for {want}: "
            "its forward does not honour logits_to_keep, so it cannot be scored packed"
        )


def _forward_scores(model: nn.Module, scorer: Scorer, **inputs) -> tuple[Tensor, Tensor | None]:
    slot = head_slot(model)
    keep = slot is not None and slot.head in _FULL_LOGITS
    # full logits under a sampling that shapes them (top-k, top-p, penalty) stay the model's
    if slot is not None and (scorer.sampling.plain or not keep):
        head = _ScoringHead(slot.head, scorer, in_place=_runs_as_it_is(model), keep=keep)
        with slot.holding(head):
            out = model(**inputs)
        if out.logits is head.output:
            _check_positions(model, head.positions, inputs)
            flat = out.logits.reshape(-1)
            targets = scorer.tokens.numel()  # one picked logit per target, then the positions
            picked, lse = flat[:targets], flat[targets:]
            return scorer.logprobs(picked, lse, *head.extras)
        # the model changed what its head returned: that forward is wasted, once per head
        _OWN_LOGITS.add(slot.head)
        print(
            f"scoring log-probs: {type(getattr(model, 'module', model)).__name__} post-processes "
            "its LM head's output (soft-capping or scaling), so the head computes full logits",
            file=sys.stderr,
            flush=True,
        )
    logits = model(**inputs).logits
    logits = logits.reshape(-1, logits.shape[-1])
    _check_positions(model, logits.shape[0], inputs)
    return scorer.of_logits(logits)


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
    """``completion_logprobs`` with every row packed by prompt (see ``pack``): end to end under
    prefix attention, else a sequence per group under a dense mask."""
    config = _config(model)
    implementation = getattr(config, "_attn_implementation", None)
    prefix = implementation == PREFIX and not attention_dropout_on(model)
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask, end_to_end=prefix)
    inputs = {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "logits_to_keep": packed.keep,
        "use_cache": False,
    }
    history = History(prompt_ids, prompt_mask, completion_ids, completion_mask)
    scorer = Scorer.of(packed.at, completion_ids, sampling, with_entropy, history, packed.kept)
    if prefix:
        # no [L, L] mask: the layout says what each token reads (grpo.scoring.prefix_attention). The
        # mask of ones keeps transformers from building one: given none, it reads packed
        # sequences from the restarting position ids and builds their block mask
        layout = prefix_layout(packed.segment, packed.group)
        mask = torch.ones_like(packed.input_ids)
        result = _scores(model, scorer, **inputs, attention_mask=mask, prefix_layout=layout)
        if not layout.uses[0]:
            raise RuntimeError(
                f"{type(model).__name__} does not pass keyword arguments to its attention, so "
                "packed scoring cannot use prefix attention: load it with attn_implementation='sdpa'"
            )
        return result
    dtype = PACKABLE[implementation] or next(model.parameters()).dtype
    return _scores(model, scorer, **inputs, attention_mask=packed.attention_mask(dtype))


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
    completion_mask = torch.arange(t, device=ids.device)[None, :] < lengths[:, None]  # [g, t]
    prompt_mask = torch.ones(g, len(prompt), dtype=torch.bool, device=ids.device)
    history = History(prompt.expand(g, -1), prompt_mask, completion_ids[:, :t], completion_mask)
    at = _row_positions(g, t, ids.device)
    scorer = Scorer.of(at, completion_ids[:, :t], sampling, with_entropy, history, g * (t + 1))
    return _scores(model, scorer, input_ids=ids, logits_to_keep=t + 1, use_cache=False)


def _row_positions(b: int, t: int, device: torch.device) -> Tensor:
    """[b, t]: of each row's t + 1 kept positions (S-1 .. S+T-1), position S-1+j predicts
    completion token j; the last one predicts past the end and is not read."""
    return torch.arange(b * (t + 1), device=device).view(b, t + 1)[:, :t]


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
    """Rows of a micro-batch packed by prompt: each group is its prompt once, followed by the
    completions that share it, each without its last token (nothing after it is predicted).

    Two layouts: one left-padded sequence per group ([U, L], for a dense mask, whose size
    grows with each sequence's square), or every group end to end in one sequence ([1, N], for
    prefix attention, which needs no mask: no position is padding, and the LM head sees only
    the positions that predict a completion token, and the tokens every prompt starts with,
    such as a system prompt, come once, first). ``segment`` is 0 on a prompt, k on its group's
    k-th completion and -1 on padding; ``group`` is the group's index, -1 on padding and
    ``SHARED`` on the shared start.
    """

    input_ids: Tensor  # [U, L] or [1, N]
    position_ids: Tensor  # a completion's tokens continue its prompt's positions
    segment: Tensor
    group: Tensor
    # ``logits_to_keep``: the last ``keep`` positions of every sequence, or these positions of
    # the one sequence; either way they hold every predicting position
    keep: int | Tensor
    at: Tensor  # [B, T] index into the kept positions predicting completion token j

    @property
    def kept(self) -> int:
        """How many positions the LM head runs on."""
        if isinstance(self.keep, Tensor):
            return self.keep.numel()
        return self.input_ids.shape[0] * self.keep

    def attention_mask(self, dtype: torch.dtype) -> Tensor:
        """[U, 1, L, L]: a token sees earlier tokens of its own segment and its group's prompt.

        Boolean (True = attend) for SDPA, additive (0 / most negative) for eager attention.
        Padding sees earlier padding, so no row of the softmax is empty.
        """
        n = self.segment.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.segment.device).tril()
        query, key = self.segment[:, :, None], self.segment[:, None, :]
        query_group, key_group = self.group[:, :, None], self.group[:, None, :]
        same_group = (query_group == key_group) | ((key_group == SHARED) & (query_group >= 0))
        allowed = (causal & same_group & ((key == 0) | (key == query)))[:, None]
        if dtype == torch.bool:
            return allowed
        zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


def pack(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    end_to_end: bool = False,
) -> Packed:
    """Pack rows that share a prompt (see ``Packed``): a sequence per group, or with
    ``end_to_end`` all groups in one. Shapes as in ``completion_logprobs``."""
    s, device = prompt_ids.shape[1], prompt_ids.device
    distinct, prompt_of_row = torch.unique(
        torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0, return_inverse=True
    )
    # completions are right padded; a completion's last token predicts nothing, so it is left out
    body = [max(n - 1, 0) for n in completion_mask.sum(dim=1).tolist()]
    prompts = [distinct[u, :s][distinct[u, s:].bool()] for u in range(len(distinct))]
    shared = _shared_start(prompts) if end_to_end else 0
    rows_of = [(prompt_of_row == u).nonzero()[:, 0].tolist() for u in range(len(distinct))]
    own = [len(x) - shared for x in prompts]  # each prompt's tokens after the shared ones
    size = [o + sum(body[r] for r in rows) for o, rows in zip(own, rows_of, strict=True)]
    if end_to_end:
        shape = (1, shared + sum(size))
        first = list(itertools.accumulate([shared, *size[:-1]]))  # each group's first position
    else:
        longest = max(size)
        shape = (len(distinct), longest)
        first = [u * longest + longest - n for u, n in enumerate(size)]  # left padded
    count = shape[0] * shape[1]
    input_ids = torch.zeros(count, dtype=torch.long, device=device)
    position_ids = torch.zeros(count, dtype=torch.long, device=device)
    segment = torch.full((count,), -1, dtype=torch.long, device=device)
    group = torch.full((count,), -1, dtype=torch.long, device=device)
    input_ids[:shared] = prompts[0][:shared]
    position_ids[:shared] = torch.arange(shared, device=device)
    segment[:shared] = 0
    group[:shared] = SHARED
    at = torch.zeros(completion_ids.shape, dtype=torch.long, device=device)  # positions first
    predicting: list[int] = []
    for u, (prompt, rows) in enumerate(zip(prompts, rows_of, strict=True)):
        start, p, o = first[u], len(prompt), own[u]
        input_ids[start : start + o] = prompt[shared:]
        position_ids[start : start + o] = torch.arange(shared, p, device=device)
        segment[start : start + o] = 0
        group[start : start + size[u]] = u
        prompt_last = start + o - 1  # predicts every completion's token 0
        predicting.append(prompt_last)
        start += o
        for k, row in enumerate(rows, start=1):
            n, span = body[row], slice(start, start + body[row])
            input_ids[span] = completion_ids[row, :n]
            position_ids[span] = p + torch.arange(n, device=device)
            segment[span] = k
            at[row, 0] = prompt_last
            at[row, 1 : 1 + n] = torch.arange(start, start + n, device=device)
            predicting.extend(range(start, start + n))
            start += n
    if end_to_end:
        keep: int | Tensor = torch.tensor(predicting, dtype=torch.long, device=device)
        kept_at = keep
    else:
        keep = max(n - o + 1 for n, o in zip(size, own, strict=True))
        tail = torch.arange(shape[1] - keep, shape[1], device=device)
        kept_at = (torch.arange(shape[0], device=device)[:, None] * shape[1] + tail).flatten()
    index = torch.zeros(count, dtype=torch.long, device=device)  # position -> its kept index
    index[kept_at] = torch.arange(kept_at.numel(), device=device)
    view = [x.view(shape) for x in (input_ids, position_ids, segment, group)]
    return Packed(*view, keep, index[at])


def _shared_start(prompts: list[Tensor]) -> int:
    """How many leading tokens every prompt shares (a system prompt, a chat template's header),
    leaving each at least one of its own: 0 for a single prompt."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(x) for x in prompts) - 1
    first = prompts[0][:shortest]
    same = torch.stack([x[:shortest] == first for x in prompts[1:]]).all(dim=0)
    differs = (~same).nonzero()
    return int(differs[0, 0]) if len(differs) else shortest


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
    history = History(prompt_ids, prompt_mask, completion_ids, completion_mask)
    at = _row_positions(b, t, input_ids.device)
    scorer = Scorer.of(at, completion_ids, sampling, with_entropy, history, b * (t + 1))
    return _scores(
        model,
        scorer,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=t + 1,  # positions S-1 .. S+T-1
        use_cache=False,
    )
