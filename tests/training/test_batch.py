"""Rollout containers: joining rollouts of several rounds and selecting groups keep every field
of every completion, padded where the layout says (prompts left, completions right)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo.scoring.distribution import Decoding
from grpo.step_data import Rollout, concat_rollouts
from grpo.training.micro_batches import MicroBatch


def rollout(
    prompt: list[list[int]],
    completion: list[list[int]],
    tag: str,
    logp: bool = True,
    turns: bool = False,
    decoding: Decoding | None = None,
) -> Rollout:
    """One group per two rows (G = 2); ids > 0 are real tokens, 0 is padding already in place."""
    prompt_ids = torch.tensor(prompt)
    completion_ids = torch.tensor(completion)
    n = len(prompt)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_ids > 0,
        completion_ids=completion_ids,
        completion_mask=completion_ids > 0,
        truncated=torch.tensor([i % 2 == 1 for i in range(n)]),
        prompts=[f"{tag}p{i}" for i in range(n)],
        completions=[f"{tag}c{i}" for i in range(n)],
        rows=[{"prompt": f"{tag}{i}"} for i in range(n // 2)],
        group_size=2,
        sampler_logp=-completion_ids.float() / 10 if logp else None,
        sampled_mask=(completion_ids % 2 == 1) if turns else None,
        turns=[[{"text": f"{tag}t{i}"}] for i in range(n)] if turns else None,
        decoding=decoding or Decoding(),
    )


A = rollout([[1, 2], [0, 3]], [[4, 5, 6], [7, 0, 0]], "a")
B = rollout([[8, 9, 10], [11, 12, 13]], [[14], [15]], "b")


def test_concat_pads_prompts_left_and_completions_right() -> None:
    joined = concat_rollouts([A, B])
    assert joined.prompt_ids.tolist() == [[0, 1, 2], [0, 0, 3], [8, 9, 10], [11, 12, 13]]
    assert joined.prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1], [1, 1, 1]]
    assert joined.completion_ids.tolist() == [[4, 5, 6], [7, 0, 0], [14, 0, 0], [15, 0, 0]]
    assert joined.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]]
    assert joined.prompt_ids.dtype == torch.long and joined.completion_mask.dtype == torch.bool
    assert joined.truncated.tolist() == [False, True, False, True]
    assert joined.sampler_logp is not None
    assert torch.allclose(
        joined.sampler_logp,
        torch.tensor([[-0.4, -0.5, -0.6], [-0.7, 0, 0], [-1.4, 0, 0], [-1.5, 0, 0]]),
    )
    assert joined.prompts == ["ap0", "ap1", "bp0", "bp1"]
    assert joined.completions == ["ac0", "ac1", "bc0", "bc1"]
    assert joined.rows == [{"prompt": "a0"}, {"prompt": "b0"}]
    assert joined.group_size == 2
    assert joined.sampled_mask is None and joined.turns is None


def test_concat_of_one_rollout_is_that_rollout() -> None:
    assert concat_rollouts([A]) is A


def test_concat_drops_sampler_logprobs_unless_every_part_has_them() -> None:
    plain = rollout([[8, 9]], [[14]], "b", logp=False)
    assert concat_rollouts([A, plain]).sampler_logp is None


def test_concat_keeps_multi_turn_masks_and_counts_single_turn_tokens_as_sampled() -> None:
    tools = rollout([[1, 2], [3, 4]], [[5, 6, 7], [9, 0, 0]], "t", turns=True)
    joined = concat_rollouts([tools, B])
    assert joined.sampled_mask is not None and joined.turns is not None
    # the multi-turn part keeps its tool-output holes; the plain part's tokens all count
    assert joined.sampled_mask.tolist() == [
        [True, False, True],
        [True, False, False],
        [True, False, False],
        [True, False, False],
    ]
    assert [t[0]["text"] for t in joined.turns] == ["tt0", "tt1"]


def test_concat_refuses_rollouts_sampled_under_different_controls() -> None:
    hot = rollout([[8, 9]], [[14]], "b", decoding=Decoding(temperature=1.3))
    with pytest.raises(ValueError, match="different controls"):
        concat_rollouts([A, B, hot])
    same = rollout([[8, 9]], [[14]], "b", decoding=Decoding(temperature=1.3))
    assert concat_rollouts([hot, same]).decoding == Decoding(temperature=1.3)


def test_select_groups_keeps_the_chosen_groups_in_order() -> None:
    joined = concat_rollouts([A, B])
    picked = joined.select_groups([1, 0])
    assert picked.completions == ["bc0", "bc1", "ac0", "ac1"]
    assert picked.rows == [{"prompt": "b0"}, {"prompt": "a0"}]
    assert picked.prompt_ids.tolist() == [[8, 9, 10], [11, 12, 13], [0, 1, 2], [0, 0, 3]]
    assert picked.truncated.tolist() == [False, True, False, True]
    assert picked.sampler_logp is not None
    assert torch.equal(picked.sampler_logp, joined.sampler_logp[[2, 3, 0, 1]])


def test_concat_keeps_each_fields_dtype_when_it_pads() -> None:
    # an engine's int32 token ids stay int32: the padding takes the field's dtype
    small = rollout([[1, 2]], [[4, 5, 6]], "a")
    small.prompt_ids, small.completion_ids = small.prompt_ids.int(), small.completion_ids.int()
    wide = rollout([[8, 9, 10]], [[14]], "b")
    wide.prompt_ids, wide.completion_ids = wide.prompt_ids.int(), wide.completion_ids.int()
    joined = concat_rollouts([small, wide])
    assert joined.prompt_ids.dtype == joined.completion_ids.dtype == torch.int32
    assert joined.prompt_ids.tolist() == [[0, 1, 2], [8, 9, 10]]
    assert joined.completion_ids.tolist() == [[4, 5, 6], [14, 0, 0]]


def test_concat_names_the_mixed_controls_in_its_error() -> None:
    hot = rollout([[8, 9]], [[14]], "b", decoding=Decoding(temperature=1.3))
    with pytest.raises(
        ValueError, match=r"^rollouts sampled under different controls cannot share a step$"
    ):
        concat_rollouts([A, hot])


def test_select_groups_keeps_multi_turn_fields_and_the_sampling_controls() -> None:
    hot = Decoding(temperature=1.3, top_k=5)
    tools = rollout(
        [[1, 2], [3, 4], [5, 6], [7, 8]], [[5, 6], [9, 0], [3, 3], [1, 2]], "t", True, True, hot
    )
    picked = tools.select_groups([1, 0])
    assert picked.decoding == hot
    assert picked.sampler_logp is not None and picked.sampled_mask is not None
    assert torch.equal(picked.sampler_logp, tools.sampler_logp[[2, 3, 0, 1]])
    assert picked.sampled_mask.tolist() == [
        [True, True],
        [True, False],
        [True, False],
        [True, False],
    ]
    assert picked.turns is not None
    assert [t[0]["text"] for t in picked.turns] == ["tt2", "tt3", "tt0", "tt1"]


def test_selecting_no_group_gives_an_empty_rollout() -> None:
    # a rank whose share of a round is empty selects no group
    empty = A.select_groups([])
    assert empty.num_completions == 0 and empty.prompts == [] and empty.rows == []
    assert empty.prompt_ids.shape == (0, 2) and empty.completion_ids.shape == (0, 3)
    assert empty.prompt_ids.dtype == torch.long
    assert empty.sampler_logp is not None and empty.sampler_logp.shape == (0, 3)


def test_a_micro_batch_moves_every_tensor_to_the_device_and_keeps_its_controls() -> None:
    # the update moves each micro-batch to the rank's device; "meta" (shapes and dtypes, no
    # data) stands in for an accelerator on a CPU-only machine
    hot = Decoding(temperature=0.7, top_k=5)
    mb = MicroBatch(
        index=torch.tensor([0, 1]),
        prompt_ids=A.prompt_ids,
        prompt_mask=A.prompt_mask,
        completion_ids=A.completion_ids,
        completion_mask=A.completion_mask,
        loss_mask=A.completion_mask,
        advantages=torch.tensor([0.5, -0.5]),
        decoding=hot,
    )
    moved = mb.to(torch.device("meta"))
    tensors = [f.name for f in dataclasses.fields(MicroBatch) if f.name != "decoding"]
    for name in tensors:
        before, after = getattr(mb, name), getattr(moved, name)
        assert after.device.type == "meta", name
        assert (after.shape, after.dtype) == (before.shape, before.dtype), name
    assert moved.decoding == hot
