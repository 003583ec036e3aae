"""Gathering scored groups across ranks, on one process (the two-process gather over gloo is
tests/integration/test_distributed.py::test_gathered_groups_can_be_trained_on)."""

from __future__ import annotations

import torch

from grpo.step_data import Scored
from grpo.training.gather import empty_rollout, gather_scored


def test_an_empty_rollout_has_no_rows_and_the_field_kinds_of_a_full_one() -> None:
    rollout = empty_rollout(3)
    assert rollout.group_size == 3 and rollout.num_completions == 0
    for ids, mask in [
        (rollout.prompt_ids, rollout.prompt_mask),
        (rollout.completion_ids, rollout.completion_mask),
    ]:
        assert ids.shape == mask.shape == (0, 1)
        assert (ids.dtype, mask.dtype) == (torch.long, torch.bool)
    assert rollout.truncated.shape == (0,) and rollout.truncated.dtype == torch.bool
    assert rollout.prompts == rollout.completions == rollout.rows == []
    assert rollout.sampler_logp is None and rollout.turns is None
    assert rollout.loss_mask.shape == (0, 1)


def test_one_process_gathers_itself() -> None:
    rollout = empty_rollout(2)
    none = torch.zeros(0)
    scored = Scored(rollout, torch.zeros(0, 1), ["r"], none, none, {"r": 3})
    assert gather_scored(scored) is scored  # the same object: nothing copied, errors unsummed
