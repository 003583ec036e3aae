"""Micro-batches by rows and by a token budget; the log-prob backward stays linear in their size."""

from __future__ import annotations

import pytest
import torch

import grpo.trainer
from grpo.logprobs import token_logprobs
from grpo.trainer import Trainer, cut_micro_batches

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


def test_micro_batch_tokens_reaches_the_trainer(tiny_config, monkeypatch) -> None:
    # the same rollout trained with and without a budget: the budget makes more, smaller passes
    seen: list[int] = []
    original = grpo.trainer.completion_logprobs

    def count(model, prompt_ids, *args, **kwargs):
        seen.append(prompt_ids.shape[0])
        return original(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(grpo.trainer, "completion_logprobs", count)
    sizes = {}
    for budget in (None, 40):
        config = tiny_config(algorithm={"beta": 0.0}, optim={"micro_batch_size": 8})
        config.optim.micro_batch_tokens = budget
        trainer = Trainer(config)
        scored = trainer.score(trainer.rollout())
        seen.clear()
        trainer.optimize(scored)
        sizes[budget] = list(seen)
    assert sizes[None] == [8]
    assert len(sizes[40]) > 1 and sum(sizes[40]) == 8


def test_a_rank_with_fewer_micro_batches_splits_to_match_the_others(
    tiny_config, monkeypatch
) -> None:
    # DDP reduces gradients once per backward, so every rank runs as many as the rank with most
    # micro-batches: here another rank (faked by the max all-reduce) needs one more than this one
    trainer = Trainer(tiny_config(algorithm={"beta": 0.0}, optim={"micro_batch_size": 8}))
    scored = trainer.score(trainer.rollout())
    original = grpo.trainer.distributed.all_reduce

    def another_rank_needs_one_more(value, op="sum"):
        return value + 1 if op == "max" and isinstance(value, int) else original(value, op)

    monkeypatch.setattr(grpo.trainer.distributed, "all_reduce", another_rank_needs_one_more)
    seen: list[int] = []
    original_logprobs = grpo.trainer.completion_logprobs

    def count(model, prompt_ids, *args, **kwargs):
        seen.append(prompt_ids.shape[0])
        return original_logprobs(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(grpo.trainer, "completion_logprobs", count)
    trainer.optimize(scored)
    assert seen == [4, 4]  # one micro-batch of 8 rows halved: two backward passes, every row


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
