"""Cutting a scored rollout into micro-batches: whole groups, longest first, within a row and
(optionally) a packed-token budget, each trimmed of pure padding."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.scoring.distribution import Decoding
from grpo.step_data import Rollout


@dataclass
class MicroBatch:
    """Views of a scored rollout for one forward/backward. Shapes [b, S'] / [b, T'] / [b]."""

    index: Tensor
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    loss_mask: Tensor  # completion_mask without tool outputs and template tokens (multi-turn)
    advantages: Tensor
    decoding: Decoding  # the controls the rollout was sampled under: the log-probs' distribution

    def to(self, device: torch.device) -> MicroBatch:
        tensors = [getattr(self, f.name).to(device) for f in dataclasses.fields(self)[:-1]]
        return MicroBatch(*tensors, self.decoding)


def micro_batch_order(prompt_len: Tensor, completion_len: Tensor, group_size: int) -> Tensor:
    """Row order for micro-batches: whole groups, longest group first. A group's completions pack
    behind one copy of its prompt (``grpo.scoring.packing.pack``), and groups of similar length share a
    micro-batch, so little is padded. [N] lengths, groups contiguous -> [N] order."""
    packed = prompt_len.view(-1, group_size)[:, 0] + completion_len.view(-1, group_size).sum(dim=1)
    groups = torch.argsort(packed, descending=True, stable=True)  # [P]
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


def cut_micro_batches(
    prompt_len: list[int],
    completion_len: list[int],
    order: list[int],
    group_size: int,
    size: int,
    max_tokens: int | None = None,
    count: int = 1,
) -> list[list[int]]:
    """Cut rows (taken in ``order``) into micro-batches of at most ``size`` rows and, with
    ``max_tokens``, at most that many packed positions (a group's prompt once per micro-batch,
    plus its completions; a row larger than the budget goes alone). Then, while there are fewer
    than ``count`` micro-batches, the one with most positions is halved (ranks must run the same
    number of backward passes). Returns row indices per micro-batch."""
    budget = max_tokens or math.inf
    cuts: list[list[int]] = []
    tokens: list[int] = []
    groups: set[int] = set()
    for row in order:
        group = row // group_size
        cost = completion_len[row] + (0 if group in groups else prompt_len[row])
        if not cuts or len(cuts[-1]) == size or tokens[-1] + cost > budget:
            cuts.append([])
            tokens.append(0)
            groups = set()
            cost = completion_len[row] + prompt_len[row]
        cuts[-1].append(row)
        tokens[-1] += cost
        groups.add(group)
    while len(cuts) < count:
        splittable = [k for k, rows in enumerate(cuts) if len(rows) > 1]
        if not splittable:
            raise RuntimeError(f"{len(order)} rows cannot make the {count} micro-batches of a rank")
        k = max(splittable, key=lambda k: tokens[k])
        rows, half = cuts[k], len(cuts[k]) // 2
        cuts[k : k + 1] = [rows[:half], rows[half:]]
        share = tokens[k] * half // len(rows)  # an estimate is enough to pick the next to halve
        tokens[k : k + 1] = [share, tokens[k] - share]
    return cuts


def micro_batches(
    rollout: Rollout,
    advantages: Tensor,
    size: int,
    max_tokens: int | None = None,
    count: int = 1,
) -> list[MicroBatch]:
    """Split into micro-batches (see ``micro_batch_order`` and ``cut_micro_batches``), each
    trimmed of pure padding."""
    prompt_len = rollout.prompt_mask.sum(dim=1)
    completion_len = rollout.completion_mask.sum(dim=1)
    order = micro_batch_order(prompt_len, completion_len, rollout.group_size)
    cuts = cut_micro_batches(
        prompt_len.tolist(),
        completion_len.tolist(),
        order.tolist(),
        rollout.group_size,
        size,
        max_tokens,
        count,
    )
    out = []
    for rows in cuts:
        idx = torch.tensor(rows, dtype=torch.long)
        pm, cm = rollout.prompt_mask[idx], rollout.completion_mask[idx]
        s_keep = int(pm.sum(dim=1).max())  # prompts are left padded: keep the last columns
        t_keep = max(int(cm.sum(dim=1).max()), 1)  # completions right padded: keep the first
        out.append(
            MicroBatch(
                index=idx,
                prompt_ids=rollout.prompt_ids[idx, -s_keep:],
                prompt_mask=pm[:, -s_keep:],
                completion_ids=rollout.completion_ids[idx, :t_keep],
                completion_mask=cm[:, :t_keep],
                loss_mask=rollout.loss_mask[idx, :t_keep],
                advantages=advantages[idx],
                decoding=rollout.decoding,
            )
        )
    return out


def scatter_rows(dest: Tensor, mb: MicroBatch, values: Tensor) -> None:
    dest[mb.index, : values.shape[1]] = values
