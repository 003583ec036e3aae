"""Token lists padded into a batch: left for prompts, right for completions and their values."""

from __future__ import annotations

import torch

from grpo.rollout.padding import left_pad, right_pad


def test_left_pad_ends_every_list_at_the_last_column() -> None:
    ids, mask = left_pad([[5, 6, 7], [8], []], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[True] * 3, [False, False, True], [False] * 3]
    assert ids.dtype == torch.long and mask.dtype == torch.bool


def test_right_pad_starts_every_list_at_the_first_column_and_keeps_one_column() -> None:
    ids, mask = right_pad([[5, 6], [7], []], 9)
    assert ids.tolist() == [[5, 6], [7, 9], [9, 9]]
    assert mask.tolist() == [[True, True], [True, False], [False, False]]
    empty, none = right_pad([[], []], 9)  # no token at all: one padded column, nothing counted
    assert empty.tolist() == [[9], [9]] and not none.any()


def test_right_pad_carries_per_token_values_in_their_dtype() -> None:
    logp, _ = right_pad([[-0.5, -1.25], [-2.0]], 0.0, torch.float32)
    assert logp.dtype == torch.float32 and logp.tolist() == [[-0.5, -1.25], [-2.0, 0.0]]
    sampled, _ = right_pad([[True, False], [True]], False, torch.bool)
    assert sampled.tolist() == [[True, False], [True, False]]
