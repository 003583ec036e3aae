"""Every rank's scored groups in one batch (metrics over all ranks; dynamic sampling's choices)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from grpo.runtime import distributed
from grpo.step_data import Rollout, Scored


def empty_rollout(group_size: int) -> Rollout:
    """A rollout of no prompts (a rank's share of a round smaller than the number of ranks)."""
    ids, mask = torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.bool)
    return Rollout(ids, mask, ids, mask, torch.zeros(0, dtype=torch.bool), [], [], [], group_size)


def _kind(value: Any) -> Any:
    """What a gathered field holds: a tensor's dtype, "list", or None."""
    if isinstance(value, Tensor):
        return value.dtype
    return "list" if isinstance(value, list) else None


def gather_scored(scored: Scored) -> Scored:
    """Every rank's scored groups concatenated in rank order (itself on one process).

    Row-aligned tensors and lists are gathered; reward function error counts are summed.
    Prompts stay left padded (to the widest rank's width), completions right padded, so the
    result can be trained on.
    """
    if not distributed.active():
        return scored

    def gather(obj: Any, skip: set[str]) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in skip:
                continue
            # a rank without prompts this round has None where the others have rows (sampler
            # log-probs, multi-turn masks and turns): it sends an empty value of their kind
            kinds = [k for k in distributed.all_gather_list([_kind(value)]) if k is not None]
            if not kinds:
                continue
            if value is None:
                value = [] if kinds[0] == "list" else torch.zeros(0, 1, dtype=kinds[0])
            if f.name in ("prompt_ids", "prompt_mask"):
                width = int(distributed.all_reduce(value.shape[1], "max"))
                value = torch.nn.functional.pad(value, (width - value.shape[1], 0))
            if isinstance(value, Tensor):
                out[f.name] = distributed.all_gather_rows(value)
            elif isinstance(value, list):
                out[f.name] = distributed.all_gather_list(value)
        return out

    # the decoding controls of a rank that sampled (a rank without prompts has the defaults)
    sampled = distributed.all_gather_list(
        [(scored.rollout.num_completions, scored.rollout.decoding)]
    )
    decoding = next((s for n, s in sampled if n), scored.rollout.decoding)
    gathered = gather(scored.rollout, {"decoding"})
    rollout = dataclasses.replace(scored.rollout, decoding=decoding, **gathered)
    errors = {
        name: int(distributed.all_reduce(scored.errors.get(name, 0)))
        for name in scored.function_names
    }
    fields = gather(scored, {"rollout", "function_names"})
    return dataclasses.replace(scored, rollout=rollout, errors=errors, **fields)
