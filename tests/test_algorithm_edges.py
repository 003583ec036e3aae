"""Edge cases of the math, worked by hand: boundaries, single tokens, empty masks, messages.

Each test here kills mutants `make mutate` found alive (README, "Tests that bite").
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm import (
    Normalizer,
    group_advantages,
    group_std,
    logprob_mismatch,
    masked_mean,
    policy_loss,
    top_entropy_mask,
    zero_std_groups,
)


def test_group_std_is_the_population_std() -> None:
    # [1, 0, 1, 0]: mean 0.5, every deviation 0.5 -> population std 0.5 (the sample std,
    # with G - 1 = 3 in the denominator, would be sqrt(1/3) = 0.577)
    assert torch.allclose(group_std(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4), torch.tensor([0.5]))
    # two groups of 2: [0, 2] -> 1, [3, 3] -> 0
    assert torch.equal(group_std(torch.tensor([0.0, 2.0, 3.0, 3.0]), 2), torch.tensor([1.0, 0.0]))


def test_zero_std_groups_includes_the_tolerance_itself() -> None:
    # [0, 1] has std 0.5 exactly: zero variance at atol 0.5 (<=), not at 0.4
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0])
    assert zero_std_groups(rewards, 2, atol=0.5).tolist() == [True, True]
    assert zero_std_groups(rewards, 2, atol=0.4).tolist() == [False, True]


def test_bnpo_with_a_single_counted_token() -> None:
    # one counted token, ratio 1, advantage 2: bnpo's token mean is -2 / 1 = -2
    logp = torch.zeros(1, 3)
    mask = torch.tensor([[True, False, False]])
    loss, _ = policy_loss(logp, logp, torch.tensor([2.0]), mask, loss_type="bnpo")
    assert float(loss) == pytest.approx(-2.0, abs=1e-6)


def test_dr_grpo_without_a_budget_names_the_field() -> None:
    logp = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    norm = Normalizer(num_sequences=1, num_tokens=2.0, max_new_tokens=None)
    with pytest.raises(
        ValueError, match=r"^loss_type='dr_grpo' needs Normalizer\.max_new_tokens \(the length"
    ):
        policy_loss(logp, logp, torch.tensor([1.0]), mask, loss_type="dr_grpo", normalizer=norm)


def test_top_entropy_mask_keeps_ties_at_the_threshold() -> None:
    # entropies 1, 2, 2, 3: the median (the 0.5 quantile) is 2, and both tokens at 2 are kept
    entropy = torch.tensor([[1.0, 2.0, 2.0, 3.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert top_entropy_mask(entropy, mask, 0.5).tolist() == [[False, True, True, True]]


def test_top_entropy_mask_of_no_counted_token_is_empty() -> None:
    entropy = torch.tensor([[1.0, 2.0]])
    mask = torch.zeros(1, 2, dtype=torch.bool)
    assert top_entropy_mask(entropy, mask, 0.5).tolist() == [[False, False]]


def test_logprob_mismatch_of_one_token_and_of_none() -> None:
    trainer = torch.tensor([[math.log(0.5), 0.0]], dtype=torch.float64)
    sampler = torch.tensor([[math.log(0.25), 5.0]], dtype=torch.float64)
    one = logprob_mismatch(trainer, sampler, torch.tensor([[True, False]]))
    assert float(one["mismatch_mean"]) == pytest.approx(math.log(2), abs=1e-12)
    assert float(one["mismatch_max"]) == pytest.approx(math.log(2), abs=1e-12)
    none = logprob_mismatch(trainer, sampler, torch.zeros(1, 2, dtype=torch.bool))
    assert set(none) == {"mismatch_mean", "mismatch_max"}
    for value in none.values():
        assert value.dtype == torch.float64 and value.shape == () and float(value) == 0.0


def test_batch_scaling_adds_eps_inside_the_root() -> None:
    # [1, 0, 1, 0]: batch variance 0.25; with eps 0.25 the denominator is sqrt(0.5)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv = group_advantages(rewards, 2, "batch", eps=0.25)
    expected = torch.tensor([0.5, -0.5, 0.5, -0.5]) / math.sqrt(0.5)
    assert torch.allclose(adv, expected, atol=1e-6)


def test_unknown_scale_is_named() -> None:
    with pytest.raises(ValueError, match="scale must be 'group', 'batch' or 'none', got 'std'"):
        group_advantages(torch.zeros(4), 2, "std")


def test_dapo_with_a_single_counted_token() -> None:
    # one counted token in the step: the step's token mean divides by 1
    logp = torch.zeros(1, 2)
    mask = torch.tensor([[True, False]])
    loss, _ = policy_loss(logp, logp, torch.tensor([3.0]), mask, loss_type="dapo")
    assert float(loss) == pytest.approx(-3.0, abs=1e-6)


def test_masked_mean_ignores_masked_values() -> None:
    values = torch.tensor([1.0, 2.0, 100.0])
    assert float(masked_mean(values, torch.tensor([True, True, False]))) == 1.5
    assert float(masked_mean(values, torch.zeros(3, dtype=torch.bool))) == 0.0


def test_beta_defaults_to_zero_even_with_a_reference() -> None:
    # a reference without beta is measured (stats) but adds nothing to the loss
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    with_ref, stats = policy_loss(logp, logp, adv, mask, ref)
    without, _ = policy_loss(logp, logp, adv, mask)
    assert float(with_ref) == float(without)
    # k3 per token: e^{d} - d - 1 with d = ref - logp = -ln 2, ln 2: mean of the two
    d = math.log(2)
    expected = ((math.exp(-d) + d - 1) + (math.exp(d) - d - 1)) / 2
    assert float(stats["kl"]) == pytest.approx(expected, abs=1e-6)
