"""The sampling distribution (grpo.scoring.distribution) on hand-computed examples, and the trainer's
processed log-probs against a slow reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LogitsProcessorList

from grpo.config import dump_config
from grpo.rollout.sampler import Chooser, SeededGroupSampler
from grpo.scoring.chunked_head import History
from grpo.scoring.distribution import Decoding, process_logits, seen_tokens, token_set
from grpo.scoring.logprobs import token_logprobs
from grpo.training.resume import open_run

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def _logp(decoding: Decoding) -> torch.Tensor:
    return torch.log_softmax(process_logits(PROBS.log(), decoding), dim=-1)


def test_top_k_keeps_the_k_largest() -> None:
    # k = 2 keeps 0.5 and 0.3: renormalised 0.5 / 0.8 = 0.625 and 0.375
    got = _logp(Decoding(top_k=2)).exp()
    assert torch.allclose(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)


def test_top_p_drops_the_tail_whose_mass_stays_within_one_minus_p() -> None:
    # ascending cumulative mass 0.05, 0.2, 0.5, 1.0; top_p 0.75 drops what stays <= 0.25
    got = _logp(Decoding(top_p=0.75)).exp()
    assert torch.allclose(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    # top_p 0.9 drops only 0.05: 0.5 / 0.95
    assert math.isclose(float(_logp(Decoding(top_p=0.9)).exp()[0, 0]), 0.5 / 0.95, rel_tol=1e-6)


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    # min_p 0.5: threshold 0.25 keeps 0.5 and 0.3; min_p 0.2: threshold 0.1 drops only 0.05
    assert torch.allclose(
        _logp(Decoding(min_p=0.5)).exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6
    )
    assert math.isclose(float(_logp(Decoding(min_p=0.2)).exp()[0, 2]), 0.15 / 0.95, rel_tol=1e-6)


def test_temperature_comes_before_truncation() -> None:
    # at T = 0.5 the probabilities square and renormalise: 0.25, 0.09, 0.0225, 0.0025 (/0.365);
    # top_p 0.9 then keeps 0.25 and 0.09 (their share 0.932 > 0.9, 0.25 alone is 0.685)
    got = _logp(Decoding(temperature=0.5, top_p=0.9)).exp()
    assert torch.allclose(got, torch.tensor([[0.25 / 0.34, 0.09 / 0.34, 0.0, 0.0]]), atol=1e-6)


def test_a_temperature_above_one_flattens_before_truncation() -> None:
    # at T = 2 the probabilities 0.64, 0.16, 0.16, 0.04 take their square roots: 0.8, 0.4, 0.4,
    # 0.2; top_k 3 keeps the first three: 0.8 / 1.6 = 0.5, 0.25, 0.25
    logits = torch.tensor([[0.64, 0.16, 0.16, 0.04]]).log()
    got = torch.softmax(process_logits(logits, Decoding(temperature=2.0, top_k=3)), dim=-1)
    assert torch.allclose(got, torch.tensor([[0.5, 0.25, 0.25, 0.0]]), atol=1e-6)


def test_the_seen_tokens_are_built_on_the_device_of_their_inputs() -> None:
    # the scorer's history lives on the accelerator with the logits it penalises; "meta"
    # (shapes and dtypes, no data) stands in for one on a CPU-only machine
    meta = torch.device("meta")
    prompt, mask = torch.tensor([[0, 3]], device=meta), torch.tensor([[False, True]], device=meta)
    completion, upto = torch.tensor([[1, 2]], device=meta), torch.tensor([1], device=meta)
    seen = seen_tokens(prompt, mask, completion, upto, 5)
    assert (seen.device, seen.shape, seen.dtype) == (meta, (1, 5), torch.bool)
    drawn = token_set(prompt, mask, 5)
    assert (drawn.device, drawn.shape, drawn.dtype) == (meta, (1, 5), torch.bool)


def test_a_penalty_without_the_seen_tokens_is_an_error() -> None:
    with pytest.raises(ValueError) as error:
        process_logits(PROBS.log(), Decoding(repetition_penalty=1.3))
    assert str(error.value) == "repetition_penalty needs the tokens seen at each position"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.5]])
    seen = torch.tensor([[True, True, True, False]])
    got = process_logits(logits, Decoding(repetition_penalty=2.0), seen)
    # 2 / 2, -1 * 2, 0.5 / 2 (positive below 1 is divided too), unseen 0.5 unchanged
    assert torch.equal(got, torch.tensor([[1.0, -2.0, 0.25, 0.5]]))


def test_seen_tokens_are_the_prompt_and_earlier_completion_tokens() -> None:
    prompt, mask = torch.tensor([[0, 3]]), torch.tensor([[False, True]])  # 0 is padding
    completion = torch.tensor([[1, 2]])
    assert seen_tokens(prompt, mask, completion, torch.tensor([1]), 5).tolist() == [
        [False, True, False, True, False]  # 3 from the prompt, 1 before position 1; not 2, not 0
    ]


def test_the_sampler_and_the_scorer_see_the_same_tokens() -> None:
    # the pad id is also a real token (`<|im_end|>` on SmolLM2): here 0 is padding in both rows
    # and a prompt token of row 0, once before a padding 0; a token is seen when it occurs at a
    # real position, whichever of its occurrences is written last
    prompt = torch.tensor([[0, 0, 4, 0, 2, 0], [0, 0, 0, 3, 3, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    scores = torch.full((2, 6), -10.0)
    scores[:, 5] = 10.0  # both rows draw token 5
    sampler = SeededGroupSampler([0, 1], 1, torch.device("cpu"))
    chooser = Chooser(
        Decoding(repetition_penalty=1.3), sampler, prompt, mask, LogitsProcessorList()
    )
    picked = chooser.pick(prompt[:, :0], scores, torch.arange(2))
    assert picked.tolist() == [5, 5]
    expected = [
        [True, False, True, False, True, True],  # 0, 4, 2 from the prompt, then the drawn 5
        [False, True, False, True, False, True],  # 3, 1 and 5; the padding 0 is not seen
    ]
    # the sampler's tokens for the second draw, the scorer's for completion position 1
    assert chooser.seen is not None and chooser.seen.tolist() == expected
    assert seen_tokens(prompt, mask, picked[:, None], torch.tensor([1, 1]), 6).tolist() == expected


@pytest.mark.parametrize(
    "decoding",
    [
        Decoding(temperature=0.7, top_k=5),
        Decoding(top_p=0.8, min_p=0.05),
        Decoding(repetition_penalty=1.3),
        Decoding(temperature=1.2, top_k=7, top_p=0.9, min_p=0.01, repetition_penalty=0.8),
    ],
)
def test_processed_logprobs_match_a_slow_reference(decoding: Decoding) -> None:
    # one logits row per (row, index), as full_sequence_logprobs lays them out, against a loop
    # that builds each position's history and applies the processors to that row alone
    gen = torch.Generator().manual_seed(0)
    b, s, t, v = 3, 4, 5, 11
    prompt = torch.randint(0, v, (b, s), generator=gen)
    prompt_mask = torch.ones(b, s, dtype=torch.bool)
    prompt_mask[0, 0] = False
    completion = torch.randint(0, v, (b, t), generator=gen)
    completion_mask = torch.ones(b, t, dtype=torch.bool)
    completion_mask[1, 3:] = False
    logits = torch.randn(b * t, v, generator=gen, requires_grad=True)
    at = torch.arange(b * t).view(b, t)
    history = History(prompt, prompt_mask, completion, completion_mask)
    for chunk in (1, 4, 64):
        got, entropy = token_logprobs(
            logits, at, completion, decoding, True, chunk=chunk, history=history
        )
        for i in range(b):
            for j in range(int(completion_mask[i].sum())):
                seen = torch.zeros(1, v, dtype=torch.bool)
                seen[0, prompt[i][prompt_mask[i]]] = True
                seen[0, completion[i, :j]] = True
                row = process_logits(logits[at[i, j]][None].detach(), decoding, seen)
                target = completion[i, j]
                if torch.isinf(row[0, target]):  # outside the kept set: scored as if kept
                    shaped = process_logits(
                        logits[at[i, j]][None].detach(),
                        dataclasses.replace(decoding, top_k=0, top_p=1.0, min_p=0.0),
                        seen,
                    )
                    row = row.clone()
                    row[0, target] = shaped[0, target]
                want = torch.log_softmax(row, dim=-1)[0, target]
                assert torch.allclose(got[i, j], want, atol=1e-5), (chunk, i, j)
                probs = torch.softmax(
                    process_logits(logits[at[i, j]][None].detach(), decoding, seen), -1
                )
                want_entropy = -(probs * probs.clamp(min=1e-30).log()).sum()
                assert torch.allclose(entropy[i, j], want_entropy, atol=1e-5)
    # differentiable in the kept logits
    (got * completion_mask).sum().backward()
    assert logits.grad.abs().sum() > 0


def test_truncation_without_a_penalty_needs_no_history_and_no_entropy() -> None:
    # top-k/top-p read no history, so a caller without one gets the same log-probs; the entropy
    # is None unless asked for
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 9, generator=gen)
    at = torch.tensor([[0, 1, 2], [3, 4, 5]])
    targets = logits.argsort(dim=-1, descending=True)[at.flatten(), torch.tensor([0, 1, 2] * 2)]
    decoding = Decoding(temperature=0.7, top_k=4, top_p=0.95)
    for chunk in (2, 64):
        got, entropy = token_logprobs(logits, at, targets.view(2, 3), decoding, chunk=chunk)
        assert entropy is None
        want = torch.log_softmax(process_logits(logits, decoding), dim=-1)[at.flatten(), targets]
        assert torch.allclose(got.flatten(), want, atol=1e-6)


def test_training_scores_under_the_controls_it_sampled_with(tiny_config) -> None:
    # top-k/top-p/penalty on: the HF engine's sampler log-probs and the trainer's must agree
    # (before the fix the trainer scored with the temperature only: gaps of ~1 nat)
    from grpo.training.trainer import Trainer

    config = tiny_config(
        rollout={"top_k": 6, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.3},
        algorithm={"beta": 0.0},
        train={"steps": 1},
    )
    trainer = Trainer(config)
    open_run(trainer.run, trainer.plan, dump_config(config))
    try:
        trainer.state.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.producer.rewards.close()
        trainer.run.release()
    assert metrics["tis/mismatch_max"] < 1e-3
