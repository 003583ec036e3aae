"""The chunked LM head: log-probs of target tokens from a model's forward, a chunk of positions at
a time.

The LM head runs only on the positions that predict completion tokens (``logits_to_keep``), and it
runs a chunk of positions at a time together with the log-normaliser, recomputed in backward
(``_ChunkedHead``; under temperature-only sampling in one float32 buffer, in place), so
neither the [positions, vocab] logits nor their gradient ever exists whole; models whose head is
no plain linear layer, or that change its output, get the full logits, normalised a chunk at a
time. Logits go through the decoding controls the engine used (``Scorer``, by
``grpo.scoring.distribution``).

Holds the ``Scorer`` (what a micro-batch's log-probs need from each chunk of logits), the head's
autograd function, the module that stands in for a model's head during a forward (``head_slot``,
``full_logits``), the input embedding's gradient added in place (``lookup_into_grad``), and the
one forward every scoring path runs (``_scores``). The head's products in bounded memory are in
``grpo.scoring.head_products``.
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

from grpo.scoring.distribution import Decoding, seen_tokens, shape_logits, truncate
from grpo.scoring.head_products import (
    add_product_,
    kept_logits,
    logits_buffer,
    logits_into,
    narrowed,
)

# positions whose log-normaliser (and, chunked, whose LM head) is computed at once: [64, V]
# float32 is 12 MiB on SmolLM2 (V = 49152), under the heap's 16 MiB mmap threshold
CHUNK = 64

# the chunked head under plain sampling (temperature only: ``Decoding.plain``) works in one
# float32 [rows, V] buffer per forward and per backward, overwritten in place, so it takes
# more positions at a time: each chunk reads the whole head weight once per product, and at
# 64 rows SmolLM2's head products ran at 204-268 GFLOP/s against 259-339 at 128-384 rows on
# the Xeon of docs/results/levers.md (one-off probe)
PLAIN_CHUNK_BYTES = 32 << 20

# rows of a [rows, V] float32 temporary per step of the in-place entropy (4 MiB)
ENTROPY_BLOCK_BYTES = 4 << 20


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
    decoding: Decoding
    with_entropy: bool
    history: History | None
    owners: tuple[Tensor, Tensor] | None  # per position, a row and index it predicts for

    @staticmethod
    def of(
        at: Tensor,
        targets: Tensor,
        decoding: Decoding | float,
        with_entropy: bool,
        history: History | None,
        positions: int,
    ) -> Scorer:
        if not isinstance(decoding, Decoding):
            decoding = Decoding(temperature=decoding)
        flat_at = at.flatten()
        order = torch.argsort(flat_at)
        owners = None
        if decoding.repetition_penalty != 1.0:
            if history is None:
                raise ValueError("repetition_penalty needs each row's history to score")
            owners = history.owners(at, positions)
        return Scorer(
            at,
            order,
            flat_at[order],
            targets.flatten()[order],
            decoding,
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
        shaped = shape_logits(part.float(), self.decoding, seen)
        lo, hi = span
        picked = shaped[self.sorted_at[lo:hi] - start, self.tokens[lo:hi]]
        kept, cutoff = truncate(shaped, self.decoding)
        lse = torch.logsumexp(kept, dim=-1)
        entropy = None
        if self.with_entropy if with_entropy is None else with_entropy:
            entropy = _Entropy.apply(kept, lse)
        return picked, lse, cutoff, entropy

    def head_chunk(self, positions: int, vocab: int) -> int:
        """Positions per chunk of the chunked head: ``CHUNK``, or under plain sampling as many
        as fit ``PLAIN_CHUNK_BYTES`` of float32 logits, spread evenly over the chunks (a ragged
        last chunk would read the whole weight for a few rows)."""
        if not self.decoding.plain:
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
        if self.decoding.temperature != 1.0:
            logits.div_(self.decoding.temperature)  # as ``shape_logits`` divides
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
        entropy: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The gradient of the raw ``logits`` ([c, V] float32) from those of ``plain_terms_``'s
        picked logits, log-normaliser and (``entropy``: its values and gradient) entropy,
        computed in ``logits`` (overwritten, returned)."""
        if self.decoding.temperature != 1.0:
            logits.div_(self.decoding.temperature)
        log_softmax = logits.sub_(lse[:, None])
        return self.softmax_grad_(log_softmax, start, span, grad_picked, grad_lse, entropy)

    def softmax_grad_(
        self,
        log_softmax: Tensor,
        start: int,
        span: tuple[int, int],
        grad_picked: Tensor,
        grad_lse: Tensor,
        entropy: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``plain_grad_`` from the log-softmax x / T - lse of the chunk's positions, in place:
        softmax * grad_lse, plus grad_picked at each target, over the temperature. ``entropy``
        (the entropy H [c] and its gradient g [c], when the loss uses it) adds
        ``dH/dx = -p (log p + H)`` times g."""
        if entropy is None:
            grad = log_softmax.exp_().mul_(grad_lse[:, None])
        else:
            value, grad_entropy = entropy
            probs = log_softmax.exp()  # the one [c, V] temporary an entropy bonus costs
            factor = log_softmax.add_(value[:, None]).mul_(-grad_entropy[:, None])
            grad = factor.add_(grad_lse[:, None]).mul_(probs)
        lo, hi = span
        # accumulate: a position shared by several targets (a prompt's last) takes each one's
        grad.index_put_(
            (self.sorted_at[lo:hi] - start, self.tokens[lo:hi]), grad_picked, accumulate=True
        )
        temperature = self.decoding.temperature
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


class _Entropy(torch.autograd.Function):
    """The entropy of each row of logits: kept [c, V] (removed tokens at -inf) and their
    log-normaliser lse [c] -> H [c], differentiable in ``kept`` (``dH/dx = -p (log p + H)``).

    Only ``kept`` and ``lse`` are saved (the log-normaliser's own backward keeps them anyway),
    so an entropy that is only logged holds no [c, V] tensor of its own."""

    @staticmethod
    def forward(ctx, kept, lse):  # type: ignore[override]
        probs = torch.softmax(kept, dim=-1)  # 0 on removed tokens
        # -sum p ln p as sum p (lse - x): no logarithm per logit (5x faster than entr) and no
        # cancellation between two large sums, each term >= 0. nansum drops the 0 * inf of a
        # removed or -inf logit; lse - lse (NaN where lse is not finite: a NaN or +inf logit,
        # or every logit -inf) keeps such a row NaN
        terms = (lse[:, None] - kept).mul_(probs)  # one [c, V] temporary, not two
        entropy = terms.nansum(dim=-1) + (lse - lse)
        ctx.save_for_backward(kept, lse, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy):  # type: ignore[override]
        kept, lse, entropy = ctx.saved_tensors
        log_probs = kept - lse[:, None]
        probs = log_probs.exp()
        # a removed token (p = 0, log p = -inf) gets no gradient, not 0 * -inf
        grad = torch.where(probs > 0, probs * (log_probs + entropy[:, None]), 0.0)
        return grad.mul_(-grad_entropy[:, None]), None


class _ChunkedHead(torch.autograd.Function):
    """The LM head and a ``Scorer``'s terms, ``chunk`` positions at a time: hidden [M, H] ->
    picked [B*T], log-normaliser [M] and entropy [M] (None unless asked for), differentiable;
    the cutoff goes to ``out``.

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
        # an output the loss does not use (the entropy, when it is only logged) gets None in
        # backward, so it costs nothing there
        ctx.set_materialize_grads(False)
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
        if keep and not scorer.decoding.plain:  # its terms would be a temperature's alone
            raise ValueError("kept logits take plain sampling (temperature only)")
        if keep:  # one product, then each chunk's terms in place
            logits = kept_logits(hidden, w, b)
            # grad: the caller's grad mode (under no_grad needs_input_grad still reads True
            # for a weight that takes gradients, and the buffer would be made ready for nothing)
            backward = grad and any(ctx.needs_input_grad[:3])
            parts = enumerate(zip(logits.split(chunk), ctx.spans, strict=True))
            terms = [scorer.plain_terms_(x, k * chunk, s, keep=backward) for k, (x, s) in parts]
            ctx.kept = logits if backward else None  # each position's log-softmax now
        else:
            parts = enumerate(zip(hidden.split(chunk), ctx.spans, strict=True))
            if scorer.decoding.plain:
                buffer = logits_buffer(hidden, weight, chunk)
                terms = [
                    scorer.plain_terms_(logits_into(buffer, h, w, b), k * chunk, s)
                    for k, (h, s) in parts
                ]
            else:
                terms = [scorer.terms(F.linear(h, w, b), k * chunk, s) for k, (h, s) in parts]
        out.append(_cat([t[2] for t in terms]))
        picked, lse = torch.cat([t[0] for t in terms]), torch.cat([t[1] for t in terms])
        entropy = _cat([t[3] for t in terms])
        # the backward's softmax on the in-place path, without a logsumexp; None: autograd's
        ctx.lse = lse.detach() if scorer.decoding.plain and not keep else None
        # what the in-place paths' entropy gradient needs (detached: an output kept on ctx
        # would hold its own graph node)
        ctx.entropy = None if entropy is None else entropy.detach()
        return picked, lse, entropy

    @staticmethod
    def backward(ctx, grad_picked, grad_lse, grad_entropy):  # type: ignore[override]
        hidden, weight, bias = ctx.saved_tensors
        if grad_picked is None:
            grad_picked = hidden.new_zeros(ctx.scorer.tokens.numel(), dtype=torch.float32)
        if grad_lse is None:
            grad_lse = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
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
        grads = _ChunkedHead.logit_grads(ctx, hidden, grad_picked, grad_lse, grad_entropy)
        for start, h, grad in grads:
            if grad_hidden is not None:
                grad_hidden[start : start + h.shape[0]] = grad @ w
            if grad_weight is not None:
                add_product_(grad_weight, grad.T, h)
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0, dtype=grad_bias.dtype)
        ctx.run_weights = ctx.entropy = None
        if into_grad:
            grad_weight = None  # already in weight.grad
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None

    @staticmethod
    def logit_grads(
        ctx, hidden: Tensor, grad_picked: Tensor, grad_lse: Tensor, grad_entropy: Tensor | None
    ) -> Iterator[tuple[int, Tensor, Tensor]]:
        """(first position, hidden states [c, H], gradient of their logits [c, V]), both in the
        forward's product dtype: every position at once from the kept log-softmax, else a
        chunk at a time from the logits computed again. ``grad_entropy``: [M], or None when
        the loss does not use the entropy."""
        scorer, chunk = ctx.scorer, ctx.chunk
        w, b = ctx.run_weights  # the forward's, so its logits come back exactly

        def entropy(start: int, stop: int) -> tuple[Tensor, Tensor] | None:
            if grad_entropy is None:
                return None
            return ctx.entropy[start:stop], grad_entropy[start:stop]

        if ctx.kept is not None:
            grad, ctx.kept = ctx.kept, None
            for k, ((lo, hi), part) in enumerate(zip(ctx.spans, grad.split(chunk), strict=True)):
                start = k * chunk
                stop = start + part.shape[0]
                scorer.softmax_grad_(
                    part,
                    start,
                    (lo, hi),
                    grad_picked[lo:hi],
                    grad_lse[start:stop],
                    entropy(start, stop),
                )
            grad = narrowed(grad, w.dtype)  # a bf16 product's operand; float32's: the buffer
            yield 0, hidden.to(w.dtype), grad
            return
        buffer = None if ctx.lse is None else logits_buffer(hidden, w, chunk)
        for k, (h, (lo, hi)) in enumerate(zip(hidden.split(chunk), ctx.spans, strict=True)):
            start, stop = k * chunk, k * chunk + h.shape[0]
            h = h.to(w.dtype)
            # an output the loss does not use gets zeros here, never None (materialized grads)
            if buffer is not None:
                grad = scorer.plain_grad_(
                    logits_into(buffer, h, w, b),
                    start,
                    (lo, hi),
                    ctx.lse[start:stop],
                    grad_picked[lo:hi],
                    grad_lse[start:stop],
                    entropy(start, stop),
                ).to(w.dtype)  # [c, V]: the products run in the forward's dtype
            else:
                logits = F.linear(h, w, b).requires_grad_()  # the forward's logits, exactly
                used = grad_entropy is not None
                with torch.enable_grad():
                    picked, lse, _, ent = scorer.terms(logits, start, (lo, hi), with_entropy=used)
                outputs, grads = [picked, lse], [grad_picked[lo:hi], grad_lse[start:stop]]
                if used:
                    outputs.append(ent)
                    grads.append(grad_entropy[start:stop])
                torch.autograd.backward(outputs, grads)
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
        picked, lse, entropy = _ChunkedHead.apply(flat, w, b, *args)
        self.extras.append(entropy)  # after the cutoff; differentiable, beside the output
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
    if slot is not None and (scorer.decoding.plain or not keep):
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
