"""Lists of tokens (or of per-token values) padded into one batch tensor and its mask."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def left_pad(seqs: Sequence[Sequence[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Token lists -> ids [B, L] and mask [B, L] (True at the tokens), padded on the left so that
    every list ends where generation starts; L is the longest list's length."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = True
    return ids, mask


def right_pad(
    seqs: Sequence[Sequence[int | float | bool]], fill: float, dtype: torch.dtype = torch.long
) -> tuple[Tensor, Tensor]:
    """Lists -> values [B, L] in ``dtype`` and mask [B, L] (True at the values), filled on the
    right with ``fill``; L is the longest list's length, at least 1."""
    width = max([1, *(len(s) for s in seqs)])
    values = torch.full((len(seqs), width), fill, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        values[i, : len(s)] = torch.tensor(s, dtype=dtype)
        mask[i, : len(s)] = True
    return values, mask
