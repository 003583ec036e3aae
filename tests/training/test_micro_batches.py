"""Micro-batches by rows and by a token budget; the log-prob backward stays linear in their size."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import grpo.training.trainer
import grpo.training.update
from grpo.scoring.distribution import Decoding
from grpo.scoring.logprobs import token_logprobs
from grpo.step_data import Rollout, Scored
from grpo.training.micro_batches import (
    cut_micro_batches,
    micro_batch_order,
    micro_batches,
    scatter_rows,
)
from grpo.training.trainer import Trainer

# G = 2, every prompt 10 tokens; completions 5, 3 | 4, 4 | 2, 1 (rows in order)
PROMPTS, COMPLETIONS, ORDER = [10] * 6, [5, 3, 4, 4, 2, 1], list(range(6))


def test_rows_only() -> None:
    assert cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=4) == [[0, 1, 2, 3], [4, 5]]
    # by default (one rank) rows that fit make one micro-batch: nothing is halved
    assert cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=8) == [ORDER]


def test_token_budget_counts_each_groups_prompt_once() -> None:
    # budget 20: group 0 costs 10 + 5 + 3 = 18; row 2 would add 10 + 4 -> 32 > 20, cut;
    # group 1: 18; group 2: 13
    cuts = cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=8, max_tokens=20)
    assert cuts == [[0, 1], [2, 3], [4, 5]]
    # budget 40: 18 + 18 = 36, then row 4 would add 12 -> 48 > 40, cut
    cuts = cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=8, max_tokens=40)
    assert cuts == [[0, 1, 2, 3], [4, 5]]
    # both limits apply: 3 rows at most
    cuts = cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=3, max_tokens=40)
    assert cuts == [[0, 1, 2], [3, 4, 5]]
    # budget 13: row 0 (15) goes alone, over it; row 1 then pays its prompt again (13);
    # rows 2 and 3 cost 14 each; group 2 costs 10 + 2 + 1 = 13
    cuts = cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=8, max_tokens=13)
    assert cuts == [[0], [1], [2], [3], [4, 5]]


def test_count_halves_the_largest_micro_batch() -> None:
    # another rank needs 3 micro-batches: [0..3] (36 positions) is halved, [4, 5] (13) kept
    cuts = cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=8, max_tokens=40, count=3)
    assert cuts == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(RuntimeError, match="cannot make the 7 micro-batches"):
        cut_micro_batches(PROMPTS, COMPLETIONS, ORDER, 2, size=8, count=7)


def test_count_halves_down_to_single_rows_and_keeps_halves_even() -> None:
    # two rows of one micro-batch make two micro-batches of one row
    assert cut_micro_batches([10, 10], [3, 3], [0, 1], 2, size=8, count=2) == [[0], [1]]
    # one group of 8 equal rows (42 positions) into 4: halved to 4 + 4 (21 each), then the
    # first half (to 10 + 11), then the other (21): 2 rows each, never 4 + 2 + 1 + 1
    cuts = cut_micro_batches([10] * 8, [4] * 8, list(range(8)), 8, size=8, count=4)
    assert cuts == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_groups_of_equal_size_keep_their_rollout_order() -> None:
    # 20 groups of 2 rows, every one 3 + 2 + 2 positions: no group is longer, none moves (a
    # sort that may swap ties would reorder them here, differently per sort kernel)
    order = micro_batch_order(torch.full((40,), 3), torch.full((40,), 2), 2)
    assert order.tolist() == list(range(40))


def test_a_micro_batch_of_one_token_completions_keeps_one_column() -> None:
    # completions 3 wide, each of the 2 rows counts one token: the rest is padding, trimmed
    rollout = Rollout(
        prompt_ids=torch.full((2, 2), 5),
        prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        completion_ids=torch.tensor([[6, 0, 0], [7, 0, 0]]),
        completion_mask=torch.tensor([[True, False, False]] * 2),
        truncated=torch.zeros(2, dtype=torch.bool),
        prompts=["p", "p"],
        completions=["a", "b"],
        rows=[{"prompt": "p"}],
        group_size=2,
    )
    (batch,) = micro_batches(rollout, torch.tensor([1.0, -1.0]), 2)
    assert batch.completion_ids.tolist() == [[6], [7]]
    assert batch.loss_mask.tolist() == [[True], [True]]


def test_groups_go_longest_first_counting_their_prompt_once() -> None:
    # G = 2. Packed: group 0 4 + 1 + 1 = 6, group 1 10 + 1 + 1 = 12, group 2 2 + 9 + 9 = 20.
    # (Rows' own lengths would tie groups 1 and 2 at 22.) Rows stay in order within a group
    prompt_len, completion_len = (
        torch.tensor([4, 4, 10, 10, 2, 2]),
        torch.tensor([1, 1, 1, 1, 9, 9]),
    )
    assert micro_batch_order(prompt_len, completion_len, 2).tolist() == [4, 5, 2, 3, 0, 1]


def _two_groups() -> Rollout:
    """G = 2, prompts left padded to 4 (group 0: 2 tokens, group 1: 4), completions right
    padded to 5 (lengths 1, 2 | 5, 3); row 2's third token is a tool's output."""
    prompt_mask = torch.tensor([[0, 0, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2, dtype=torch.bool)
    completion_mask = torch.arange(5)[None] < torch.tensor([1, 2, 5, 3])[:, None]
    sampled_mask = torch.ones(4, 5, dtype=torch.bool)
    sampled_mask[2, 2] = False
    return Rollout(
        prompt_ids=torch.arange(16).view(4, 4) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=(torch.arange(20).view(4, 5) + 100) * completion_mask,
        completion_mask=completion_mask,
        truncated=torch.zeros(4, dtype=torch.bool),
        prompts=["a", "a", "b", "b"],
        completions=["", "", "", ""],
        rows=[{}, {}],
        group_size=2,
        sampled_mask=sampled_mask,
        decoding=Decoding(temperature=0.7),
    )


def test_micro_batches_carry_their_rows_trimmed_of_padding() -> None:
    # packed: group 0 2 + 1 + 2 = 5, group 1 4 + 5 + 3 = 12: group 1 first
    first, second = micro_batches(_two_groups(), torch.tensor([1.0, -1.0, 0.5, -0.5]), size=2)
    assert first.index.tolist() == [2, 3] and second.index.tolist() == [0, 1]
    assert first.advantages.tolist() == [0.5, -0.5] and second.advantages.tolist() == [1.0, -1.0]
    # group 1 keeps every column; group 0 its prompts' last 2 and its completions' first 2
    assert first.prompt_ids.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert second.prompt_ids.tolist() == [[2, 3], [6, 7]]
    assert second.prompt_mask.all()
    assert second.completion_ids.tolist() == [[100, 0], [105, 106]]
    assert second.completion_mask.tolist() == [[True, False], [True, True]]
    # the loss mask leaves out the tool's token; every micro-batch has the rollout's controls
    assert first.loss_mask.tolist() == [[True, True, False, True, True], [True] * 3 + [False] * 2]
    assert first.decoding == second.decoding == Decoding(temperature=0.7)


def test_micro_batches_take_the_token_budget_and_the_count() -> None:
    rollout, advantages = _two_groups(), torch.zeros(4)
    # 12 packed positions at most: group 1 fits whole (12), group 0 too (5)
    assert [mb.index.tolist() for mb in micro_batches(rollout, advantages, 4, 12)] == [
        [2, 3],
        [0, 1],
    ]
    # 11: row 2 (4 + 5 = 9) then row 3 would make 12: cut; row 3 pays its prompt again (7),
    # row 0 with its own prompt (3) fits beside it (10), row 1 (2 more) does not
    assert [mb.index.tolist() for mb in micro_batches(rollout, advantages, 4, 11)] == [
        [2],
        [3, 0],
        [1],
    ]
    # another rank needs 4 micro-batches: the largest are halved
    cuts = micro_batches(rollout, advantages, 4, count=4)
    assert sorted(mb.index.tolist() for mb in cuts) == [[0], [1], [2], [3]]


def test_scatter_rows_writes_a_micro_batchs_values_back_to_its_rows() -> None:
    first, _ = micro_batches(_two_groups(), torch.zeros(4), size=2)
    dest = torch.zeros(4, 6)
    scatter_rows(dest, first, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert dest.tolist() == [[0.0] * 6] * 2 + [[1, 2, 0, 0, 0, 0], [3, 4, 0, 0, 0, 0]]


def test_a_micro_batch_moves_to_a_device_whole() -> None:
    (batch,) = micro_batches(_two_groups(), torch.arange(4.0), size=4)
    moved = batch.to(torch.device("cpu"))
    for field in dataclasses.fields(batch)[:-1]:
        assert torch.equal(getattr(moved, field.name), getattr(batch, field.name)), field.name
    assert moved.decoding is batch.decoding


def test_micro_batch_tokens_reaches_the_trainer(tiny_config, monkeypatch) -> None:
    # the same rollout trained with and without a budget: the budget makes more, smaller passes
    seen: list[int] = []
    original = grpo.training.update.completion_logprobs

    def count(model, prompt_ids, *args, **kwargs):
        seen.append(prompt_ids.shape[0])
        return original(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(grpo.training.update, "completion_logprobs", count)
    sizes = {}
    for budget in (None, 40):
        config = tiny_config(algorithm={"beta": 0.0}, optim={"micro_batch_size": 8})
        config.optim.micro_batch_tokens = budget
        trainer = Trainer(config)
        scored = trainer.producer.score(trainer.producer.rollout())
        seen.clear()
        trainer.optimize(scored)
        sizes[budget] = list(seen)
    assert sizes[None] == [8]
    assert len(sizes[40]) > 1 and sum(sizes[40]) == 8


def another_rank_needs_one_more_micro_batch(monkeypatch) -> list[int]:
    """Fake another rank whose max all-reduce asks for one micro-batch more than this one; the
    list returned fills with the rows of every scoring forward."""
    original = grpo.training.trainer.distributed.all_reduce

    def one_more(value, op="sum"):
        return value + 1 if op == "max" and isinstance(value, int) else original(value, op)

    monkeypatch.setattr(grpo.training.trainer.distributed, "all_reduce", one_more)
    seen: list[int] = []
    original_logprobs = grpo.training.update.completion_logprobs

    def count(model, prompt_ids, *args, **kwargs):
        seen.append(prompt_ids.shape[0])
        return original_logprobs(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(grpo.training.update, "completion_logprobs", count)
    return seen


def test_a_rank_with_fewer_micro_batches_splits_to_match_the_others(
    tiny_config, monkeypatch
) -> None:
    # DDP reduces gradients once per backward, so every rank runs as many as the rank with most
    # micro-batches: here another rank (faked by the max all-reduce) needs one more than this one
    trainer = Trainer(tiny_config(algorithm={"beta": 0.0}, optim={"micro_batch_size": 8}))
    scored = trainer.producer.score(trainer.producer.rollout())
    seen = another_rank_needs_one_more_micro_batch(monkeypatch)
    trainer.optimize(scored)
    assert seen == [4, 4]  # one micro-batch of 8 rows halved: two backward passes, every row


def _hand_scored() -> Scored:
    """2 groups of 4 rows, prompts 4 tokens; completions 1 token (group 0), 6 tokens (group 1).
    Packed order: group 1 (4 + 24 positions) before group 0 (4 + 4): rows 4..7, then 0..3."""
    lengths = torch.tensor([1, 1, 1, 1, 6, 6, 6, 6])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    rollout = Rollout(
        prompt_ids=torch.full((8, 4), 5),
        prompt_mask=torch.ones(8, 4, dtype=torch.bool),
        completion_ids=torch.full((8, 6), 6).masked_fill(~mask, 0),
        completion_mask=mask,
        truncated=torch.zeros(8, dtype=torch.bool),
        prompts=["p"] * 8,
        completions=["c"] * 8,
        rows=[{"prompt": "p"}] * 2,
        group_size=4,
    )
    rewards = torch.tensor([1.0, 0.0] * 4)
    return Scored(rollout, rewards[:, None], ["r"], rewards, rewards + 0.5)  # advantages


@pytest.mark.parametrize(
    ("optim", "passes"),
    [
        # rows of 3: [4, 5, 6] (10 + 6 + 6 = 22 positions), [7, 0, 1] (10 + 5 + 1), [2, 3] (6);
        # one more: the largest (22) is halved -> 1, 2, 3, 2 rows
        ({"micro_batch_size": 3}, [1, 2, 3, 2]),
        # 20 positions: [4, 5] (16), [6, 7] (16), [0, 1, 2, 3] (8); one more: the first 16 halved
        ({"micro_batch_size": 8, "micro_batch_tokens": 20}, [1, 1, 2, 4]),
    ],
)
def test_the_extra_micro_batches_keep_the_row_and_token_limits(
    tiny_config, monkeypatch, optim: dict, passes: list[int]
) -> None:
    # without the limits the 8 rows (36 positions) would be halved into 2 + 2 + 2 + 2
    trainer = Trainer(tiny_config(algorithm={"beta": 0.0}, optim=optim))
    seen = another_rank_needs_one_more_micro_batch(monkeypatch)
    trainer.optimize(_hand_scored())
    assert seen == passes


def test_gradients_cross_ranks_with_the_last_micro_batch_of_each_step(
    tiny_config, monkeypatch
) -> None:
    # 8 rows in micro-batches of 4, 2 optimizer steps: the trained model's gradients are
    # reduced over ranks in the second backward of each step only
    trainer = Trainer(
        tiny_config(algorithm={"beta": 0.0, "num_iterations": 2}, optim={"micro_batch_size": 4})
    )
    synced: list[tuple[bool, bool]] = []

    @contextlib.contextmanager
    def record(model, enabled):
        synced.append((model is trainer.train_model, enabled))
        yield

    monkeypatch.setattr(grpo.training.trainer.distributed, "gradient_sync", record)
    trainer.optimize(_hand_scored())
    assert synced == [(True, False), (True, True)] * 2


def test_the_logged_loss_is_the_step_loss_over_ranks(tiny_config, monkeypatch) -> None:
    # 2 ranks (faked), the other holding an equal share: each rank's loss is its share of the
    # step's mean loss scaled by the 2 ranks DDP averages over, so the step's loss is
    # (share + share) / 2, this rank's sum of micro-batch losses
    trainer = Trainer(tiny_config(algorithm={"beta": 0.0}, optim={"micro_batch_size": 4}))
    trainer.update.dist = dataclasses.replace(trainer.dist, world_size=2)
    original = grpo.training.trainer.distributed.all_reduce

    def two_equal_ranks(value, op="sum"):
        return 2 * value if op == "sum" else original(value, op)

    monkeypatch.setattr(grpo.training.trainer.distributed, "all_reduce", two_equal_ranks)
    losses: list[float] = []
    policy_loss = grpo.training.update.algorithm.policy_loss

    def record(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss, stats

    monkeypatch.setattr(grpo.training.update.algorithm, "policy_loss", record)
    out = trainer.optimize(_hand_scored())
    assert len(losses) == 2 and abs(sum(losses)) > 1e-3
    assert out["loss"] == pytest.approx(sum(losses), abs=1e-6)


def test_logprob_backward_splits_the_logits_once() -> None:
    # a slice per chunk would give every chunk a backward that writes a whole [M, V] gradient
    # (quadratic in the micro-batch); one split writes it once
    logits = torch.randn(300, 11, requires_grad=True)
    at, targets = torch.arange(300).view(3, 100), torch.randint(0, 11, (3, 100))
    logp, _ = token_logprobs(logits, at, targets, chunk=64)
    names, stack, seen = [], [logp.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    assert not any(n.startswith("SliceBackward") for n in names)
    assert sum(n.startswith("SplitBackward") for n in names) == 1
    # and the values and gradients are those of a plain log-softmax
    plain = logits.detach().clone().requires_grad_(True)
    expected = torch.log_softmax(plain, dim=-1)[at, targets]
    assert torch.allclose(logp, expected, atol=1e-5)
    logp.sum().backward()
    expected.sum().backward()
    assert torch.allclose(logits.grad, plain.grad, atol=1e-5)
