"""Packing: completions that share a prompt scored in one sequence.

Completions that share a prompt (a group's G samples) are packed into one sequence: the prompt
once, then each completion, each completion seeing the prompt and its own earlier tokens, nothing
else. A group then costs one prompt forward (and backward) instead of G, and no position is spent
on padding. Models the trainer loads attend with ``grpo.scoring.prefix_attention``: each completion
as a short row over its prompt, no mask; others take a dense [L, L] mask (a group of L tokens),
whose attention covers the whole square. Either way, for long completions a cost rule
(``ScoringCost.packing_pays``, priced for the square, so conservative for prefix attention) gives
the group one row per completion instead (``grpo.scoring.logprobs.group_rows_logprobs``): the
prompt repeated, no mask at all (plain causal attention), memory linear in the tokens scored.

Holds the layouts (``pack``, ``Packed``), their scoring (``packed_logprobs``), the cost rule
and which attention implementations take a packed sequence (``PACKABLE``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo.scoring.chunked_head import History, Scorer, _scores
from grpo.scoring.distribution import Decoding
from grpo.scoring.prefix_attention import PREFIX, SHARED, prefix_layout

# attention implementations that take a custom 4D mask (others get one full sequence per row);
# PREFIX takes a packed layout instead, and the mask only when it cannot (attention dropout)
PACKABLE = {"sdpa": torch.bool, "eager": None, PREFIX: torch.bool}


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
    decoding: Decoding | float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs`` with every row packed by prompt (see ``pack``): end to end under
    prefix attention, else a sequence per group under a dense mask."""
    packed, inputs = packed_inputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    history = History(prompt_ids, prompt_mask, completion_ids, completion_mask)
    scorer = Scorer.of(packed.at, completion_ids, decoding, with_entropy, history, packed.kept)
    result = _scores(model, scorer, **inputs, logits_to_keep=packed.keep)
    check_layout_used(model, inputs)
    return result


def check_layout_used(model: nn.Module, inputs: dict) -> None:
    """After a forward on ``packed_inputs``: a model whose attention never read the prefix
    layout attended across the packed completions, so its outputs are wrong. Raise."""
    layout = inputs.get("prefix_layout")
    if layout is not None and not layout.uses[0]:
        raise RuntimeError(
            f"{type(model).__name__} does not pass keyword arguments to its attention, so "
            "packed scoring cannot use prefix attention: load it with attn_implementation='sdpa'"
        )


def packed_inputs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
) -> tuple[Packed, dict]:
    """The rows packed for ``model`` (``pack``) and the keyword arguments of its forward:
    end to end under prefix attention, else a sequence per group under a dense mask. Shared by
    the policy's scoring and the critic's values (``grpo.training.critic``)."""
    implementation = getattr(_config(model), "_attn_implementation", None)
    prefix = implementation == PREFIX and not attention_dropout_on(model)
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask, end_to_end=prefix)
    inputs = {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "use_cache": False,
    }
    if prefix:
        # no [L, L] mask: the layout says what each token reads (grpo.scoring.prefix_attention). The
        # mask of ones keeps transformers from building one: given none, it reads packed
        # sequences from the restarting position ids and builds their block mask
        layout = prefix_layout(packed.segment, packed.group)
        layout.span = int(packed.position_ids.max()) + 1
        inputs |= {"attention_mask": torch.ones_like(packed.input_ids), "prefix_layout": layout}
    else:
        dtype = PACKABLE[implementation] or next(model.parameters()).dtype
        inputs["attention_mask"] = packed.attention_mask(dtype)
    return packed, inputs


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
    shape, first = _layout(size, shared, end_to_end)
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
    keep, kept_at = _kept(predicting, size, own, shape, end_to_end, device)
    index = torch.zeros(count, dtype=torch.long, device=device)  # position -> its kept index
    index[kept_at] = torch.arange(kept_at.numel(), device=device)
    view = [x.view(shape) for x in (input_ids, position_ids, segment, group)]
    return Packed(*view, keep, index[at])


def _layout(size: list[int], shared: int, end_to_end: bool) -> tuple[tuple[int, int], list[int]]:
    """The packed shape and each group's first flat position, from each group's size (its own
    prompt tokens and its completions' bodies) and the shared start's length."""
    if end_to_end:
        first = list(itertools.accumulate([shared, *size[:-1]]))  # each group's first position
        return (1, shared + sum(size)), first
    longest = max(size)
    first = [u * longest + longest - n for u, n in enumerate(size)]  # left padded
    return (len(size), longest), first


def _kept(
    predicting: list[int],
    size: list[int],
    own: list[int],
    shape: tuple[int, int],
    end_to_end: bool,
    device: torch.device,
) -> tuple[int | Tensor, Tensor]:
    """``Packed.keep`` and the flat positions it keeps: end to end, the predicting positions
    themselves; else the last ``keep`` of each sequence, enough for its longest group."""
    if end_to_end:
        keep = torch.tensor(predicting, dtype=torch.long, device=device)
        return keep, keep
    last = max(n - o + 1 for n, o in zip(size, own, strict=True))
    tail = torch.arange(shape[1] - last, shape[1], device=device)
    return last, (torch.arange(shape[0], device=device)[:, None] * shape[1] + tail).flatten()


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
