"""The core math on hand-computed examples, against slow references, and by gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm import (
    LossKnobs,
    Normalizer,
    group_advantages,
    group_std,
    kl_k1,
    kl_k2,
    kl_k3,
    logprob_mismatch,
    masked_mean,
    policy_loss,
    top_entropy_mask,
    zero_std_groups,
)


def test_seed_worked_example() -> None:
    # rewards 1,0,1,0: mean 0.5, population std 0.5 -> advantages +1,-1,+1,-1
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-6)


def test_zero_variance_group_is_exactly_zero() -> None:
    adv = group_advantages(torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 1.0]), group_size=3)
    assert torch.equal(adv[:3], torch.zeros(3))
    # second group: mean 2/3, var 2/9 -> (1-2/3)/sqrt(2/9) = 0.7071, (0-2/3)/0.4714 = -1.4142
    assert torch.allclose(adv[3:], torch.tensor([0.70710678, -1.41421356, 0.70710678]), atol=1e-6)


def test_groups_are_contiguous_blocks() -> None:
    # [1,0 | 5,5]: first group +-1, second group all zero; interleaving would differ
    adv = group_advantages(torch.tensor([1.0, 0.0, 5.0, 5.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-6)


def test_advantages_against_a_slow_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(6 * 5, generator=gen)
    eps = 1e-8
    expected = []
    for g in range(6):
        group = rewards[g * 5 : (g + 1) * 5].tolist()
        mu = sum(group) / 5
        sigma = math.sqrt(sum((r - mu) ** 2 for r in group) / 5 + eps)
        expected += [(r - mu) / sigma for r in group]
    assert torch.allclose(group_advantages(rewards, 5), torch.tensor(expected), atol=1e-6)


def test_batch_and_no_scaling() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    # centred per group: [0.5, -0.5, 0, 0]; batch population std of the raw rewards:
    # mean 1.75, deviations [-0.75,-1.75,1.25,1.25] -> var (0.5625+3.0625+1.5625*2)/4 = 1.6875
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])
    assert torch.allclose(group_advantages(rewards, 2, scale="none"), centred, atol=1e-6)
    batch = group_advantages(rewards, 2, scale="batch")
    assert torch.allclose(batch, centred / math.sqrt(1.6875 + 1e-8), atol=1e-6)


def test_bad_group_size_is_an_error() -> None:
    with pytest.raises(ValueError, match="divisible by group_size=3"):
        group_advantages(torch.zeros(4), 3)


def test_kl_estimators() -> None:
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -2.0, -0.1])
    # k3 = exp(ref-logp) - (ref-logp) - 1: d=-1 -> e^-1 + 1 - 1 = 0.367879; d=0 -> 0;
    # d=0.4 -> e^0.4 - 0.4 - 1 = 0.091825
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([0.367879, 0.0, 0.091825]), atol=1e-6)
    assert torch.allclose(kl_k1(logp, ref), torch.tensor([1.0, 0.0, -0.4]), atol=1e-6)
    assert torch.allclose(kl_k2(logp, ref), torch.tensor([0.5, 0.0, 0.08]), atol=1e-6)
    many = torch.randn(1000) * 3
    assert (kl_k3(many, torch.randn(1000) * 3) >= 0).all()


# Two completions, three token slots; the first has 2 real tokens, the second 3.
MASK = torch.tensor([[True, True, False], [True, True, True]])
ADV = torch.tensor([2.0, -1.0])


def _loss(loss_type: str, logp: torch.Tensor | None = None, **kw) -> torch.Tensor:
    logp = torch.zeros(2, 3) if logp is None else logp
    norm = Normalizer(num_sequences=2, num_tokens=5.0, max_new_tokens=4)
    loss, _ = policy_loss(
        logp,
        torch.zeros(2, 3),
        ADV,
        MASK,
        knobs=LossKnobs(loss_type=loss_type, **kw),
        normalizer=norm,
    )
    return loss


def test_aggregations_by_hand() -> None:
    # ratio 1 everywhere, beta 0: per-token loss = -A -> row 0: -2,-2 ; row 1: +1,+1,+1
    # grpo: per-sequence means -2 and +1, averaged over 2 sequences -> -0.5
    assert torch.allclose(_loss("grpo"), torch.tensor(-0.5), atol=1e-6)
    # bnpo / dapo: token mean (-2-2+1+1+1)/5 = -0.2
    assert torch.allclose(_loss("bnpo"), torch.tensor(-0.2), atol=1e-6)
    assert torch.allclose(_loss("dapo"), torch.tensor(-0.2), atol=1e-6)
    # dr_grpo: token sum -1 over 2 sequences x budget 4 -> -0.125
    assert torch.allclose(_loss("dr_grpo"), torch.tensor(-0.125), atol=1e-6)


def test_dr_grpo_budget_defaults_to_the_batch_length_and_is_required_when_given() -> None:
    # no normalizer: the batch is the step and its T = 3 slots are the budget;
    # token sum -1 over 2 sequences x 3 -> -1/6 (not -1/2, the sum over sequences alone)
    loss, _ = policy_loss(
        torch.zeros(2, 3), torch.zeros(2, 3), ADV, MASK, knobs=LossKnobs(loss_type="dr_grpo")
    )
    assert torch.allclose(loss, torch.tensor(-1 / 6), atol=1e-6)
    # step-wide counts without the budget: an error, never a silent constant
    norm = Normalizer(num_sequences=2, num_tokens=5.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            ADV,
            MASK,
            knobs=LossKnobs(loss_type="dr_grpo"),
            normalizer=norm,
        )


def test_clipping_by_hand() -> None:
    adv = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.ones(3, 1, dtype=torch.bool)
    logp = torch.tensor([[0.5], [-0.5], [0.5]])  # ratios e^0.5=1.6487, e^-0.5=0.6065, 1.6487
    loss, stats = policy_loss(logp, torch.zeros(3, 1), adv, mask, knobs=LossKnobs(loss_type="bnpo"))
    # row 0: A=+1, ratio clipped to 1.2 -> -1.2
    # row 1: A=-1, min(-0.6065, -0.8) = -0.8 -> +0.8 (clipped from below)
    # row 2: A=-1, min(-1.6487, -1.2) = -1.6487 -> +1.6487 (the pessimistic, unclipped side)
    expected = (-1.2 + 0.8 + math.exp(0.5)) / 3
    assert torch.allclose(loss, torch.tensor(expected), atol=1e-6)
    assert torch.allclose(stats["clip_frac/high"], torch.tensor(1 / 3), atol=1e-6)
    assert torch.allclose(stats["clip_frac/low"], torch.tensor(1 / 3), atol=1e-6)
    assert torch.allclose(stats["ratio/max"], torch.tensor(math.exp(0.5)), atol=1e-6)
    assert torch.allclose(stats["ratio/min"], torch.tensor(math.exp(-0.5)), atol=1e-6)
    # dual clip c=1.5 caps row 2 at -c*A = 1.5
    dual, _ = policy_loss(
        logp, torch.zeros(3, 1), adv, mask, knobs=LossKnobs(loss_type="bnpo", dual_clip=1.5)
    )
    assert torch.allclose(dual, torch.tensor((-1.2 + 0.8 + 1.5) / 3), atol=1e-6)


def test_asymmetric_clip_high() -> None:
    # DAPO clip-higher: ratio 1.25 with A=1 is inside 1+0.28, so it is not clipped
    logp = torch.tensor([[math.log(1.25)]])
    loss, stats = policy_loss(
        logp,
        torch.zeros(1, 1),
        torch.ones(1),
        torch.ones(1, 1, dtype=torch.bool),
        knobs=LossKnobs(clip_low=0.2, clip_high=0.28),
    )
    assert torch.allclose(loss, torch.tensor(-1.25), atol=1e-6)
    assert stats["clip_frac/high"] == 0


def test_kl_penalty_in_loss() -> None:
    # one token, A=0: loss = beta * k3 = 0.04 * 0.367879
    loss, stats = policy_loss(
        torch.tensor([[-1.0]]),
        torch.tensor([[-1.0]]),
        torch.zeros(1),
        torch.ones(1, 1, dtype=torch.bool),
        torch.tensor([[-2.0]]),
        knobs=LossKnobs(beta=0.04),
    )
    assert torch.allclose(loss, torch.tensor(0.04 * 0.367879), atol=1e-6)
    assert torch.allclose(stats["kl"], torch.tensor(0.367879), atol=1e-6)


def test_sequence_level_ratio() -> None:
    # GSPO: row log-ratio mean over its 2 real tokens = (0.1 + 0.3)/2 = 0.2 -> ratio e^0.2 = 1.2214
    # for both tokens; clip_high 0.3 leaves it unclipped; loss = -A * 1.2214 = -1.2214 (grpo agg.)
    logp = torch.tensor([[0.1, 0.3, 9.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = policy_loss(
        logp,
        torch.zeros(1, 3),
        torch.ones(1),
        mask,
        knobs=LossKnobs(ratio_level="sequence", clip_high=0.3),
    )
    assert torch.allclose(loss, torch.tensor(-math.exp(0.2)), atol=1e-6)
    assert torch.allclose(stats["ratio/mean"], torch.tensor(math.exp(0.2)), atol=1e-6)


def test_gradient_is_minus_advantage_over_length_and_group() -> None:
    # ratio 1, beta 0, grpo: d loss / d logp_{i,t} = -A_i / (|o_i| * G) on counted tokens
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2, 3), ADV, MASK, knobs=LossKnobs(loss_type="grpo"))
    loss.backward()
    expected = torch.tensor([[-2 / (2 * 2), -2 / (2 * 2), 0.0], [1 / (3 * 2)] * 3])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_masked_positions_change_neither_loss_nor_gradient(
    loss_type: str, ratio_level: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, generator=gen) * 0.1
    old = torch.randn(2, 3, generator=gen) * 0.1
    ref = torch.randn(2, 3, generator=gen) * 0.1
    results = []
    for fill in (0.0, 1e4, float("inf")):
        logp = base.clone()
        logp[~MASK] = fill
        logp.requires_grad_(True)
        old_filled = old.clone()
        old_filled[~MASK] = -fill
        loss, _ = policy_loss(
            logp,
            old_filled,
            ADV,
            MASK,
            ref,
            knobs=LossKnobs(beta=0.1, loss_type=loss_type, ratio_level=ratio_level),
            normalizer=Normalizer(num_sequences=2, num_tokens=5.0, max_new_tokens=4),
        )
        loss.backward()
        results.append((loss.detach(), logp.grad.clone()))
    for loss, grad in results[1:]:
        assert torch.allclose(loss, results[0][0], atol=1e-6)
        assert torch.allclose(grad, results[0][1], atol=1e-6)
        assert torch.equal(grad[~MASK], torch.zeros(1))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"])
def test_micro_batches_sum_to_the_full_batch(loss_type: str) -> None:
    # gradient accumulation: the normalizer makes micro-batch losses add up to the step's loss
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 5, generator=gen) * 0.1
    old = torch.randn(4, 5, generator=gen) * 0.1
    adv = torch.randn(4, generator=gen)
    mask = torch.rand(4, 5, generator=gen) > 0.3
    mask[:, 0] = True
    full = policy_loss(logp, old, adv, mask, knobs=LossKnobs(loss_type=loss_type))[0]
    norm = Normalizer(
        num_sequences=4, num_tokens=float(mask.sum()), num_micro_batches=2, max_new_tokens=5
    )
    parts = sum(
        policy_loss(
            logp[s], old[s], adv[s], mask[s], knobs=LossKnobs(loss_type=loss_type), normalizer=norm
        )[0]
        for s in (slice(0, 2), slice(2, 4))
    )
    if loss_type == "bnpo":
        # bnpo is by definition the mean of the micro-batches' token means
        halves = [
            policy_loss(logp[s], old[s], adv[s], mask[s], knobs=LossKnobs(loss_type="bnpo"))[0]
            for s in (slice(0, 2), slice(2, 4))
        ]
        full = (halves[0] + halves[1]) / 2
    assert torch.allclose(parts, full, atol=1e-5)


# ------------------------------------------------------------------------------ edge cases
# boundaries, single tokens, empty masks and messages: each kills a mutant `make mutate` found
# alive (docs/testing.md, "Mutation testing")


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
    loss, _ = policy_loss(logp, logp, torch.tensor([2.0]), mask, knobs=LossKnobs(loss_type="bnpo"))
    assert float(loss) == pytest.approx(-2.0, abs=1e-6)


def test_dr_grpo_without_a_budget_names_the_field() -> None:
    logp = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    norm = Normalizer(num_sequences=1, num_tokens=2.0, max_new_tokens=None)
    with pytest.raises(
        ValueError, match=r"^loss_type='dr_grpo' needs Normalizer\.max_new_tokens \(the length"
    ):
        policy_loss(
            logp,
            logp,
            torch.tensor([1.0]),
            mask,
            knobs=LossKnobs(loss_type="dr_grpo"),
            normalizer=norm,
        )


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
    loss, _ = policy_loss(logp, logp, torch.tensor([3.0]), mask, knobs=LossKnobs(loss_type="dapo"))
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


def test_dual_clip_caps_only_negative_advantages_at_c_times_a() -> None:
    # ratio 5 (log-ratio ln 5), clip 0.2, dual clip c = 3
    logp = torch.tensor([[math.log(5.0)], [math.log(5.0)], [0.0]])
    old = torch.zeros(3, 1)
    mask = torch.ones(3, 1, dtype=torch.bool)
    adv = torch.tensor([-2.0, 0.5, 0.5])
    per_row = [
        policy_loss(
            logp[i : i + 1],
            old[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            knobs=LossKnobs(dual_clip=3.0),
        )[0]
        for i in range(3)
    ]
    # A = -2: -min(5 * -2, 1.2 * -2) = 10, capped at -c * A = 6
    assert float(per_row[0]) == pytest.approx(6.0, abs=1e-5)
    # A = 0.5 > 0: no cap; ratio 5 is clipped to 1.2: -min(2.5, 0.6) = -0.6
    assert float(per_row[1]) == pytest.approx(-0.6, abs=1e-5)
    # ratio 1, A = 0.5: -0.5 (a cap at -c * A = -1.5 would lower it)
    assert float(per_row[2]) == pytest.approx(-0.5, abs=1e-5)


def test_clip_fractions_count_strictly_outside_and_by_the_sign_of_a() -> None:
    # ratio 1 everywhere: with clip ranges 0 no token is outside [1, 1] (strict comparisons)
    logp = torch.zeros(3, 1)
    mask = torch.ones(3, 1, dtype=torch.bool)
    adv = torch.tensor([-1.0, 0.0, 1.0])
    _, stats = policy_loss(logp, logp, adv, mask, knobs=LossKnobs(clip_low=0.0, clip_high=0.0))
    assert float(stats["clip_frac/low"]) == 0.0 and float(stats["clip_frac/high"]) == 0.0
    # ratios 0.5 and 1.1 (clip 0.2): 0.5 < 0.8 is clipped low only where A < 0; 1.1 is inside
    logp = torch.log(torch.tensor([[0.5], [0.5], [0.5], [1.1]]))
    old = torch.zeros(4, 1)
    adv = torch.tensor([-1.0, 0.0, 0.5, -1.0])
    _, stats = policy_loss(logp, old, adv, torch.ones(4, 1, dtype=torch.bool))
    assert float(stats["clip_frac/low"]) == pytest.approx(1 / 4)
    # ratio 2 (> 1.2) is clipped high only where A > 0
    logp = torch.log(torch.tensor([[2.0], [2.0], [2.0]]))
    adv = torch.tensor([1.0, 0.0, -1.0])
    _, stats = policy_loss(logp, torch.zeros(3, 1), adv, torch.ones(3, 1, dtype=torch.bool))
    assert float(stats["clip_frac/high"]) == pytest.approx(1 / 3)


def test_float64_in_float64_out_and_ratio_stats_of_an_empty_mask() -> None:
    logp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.7, -0.9]], dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, stats = policy_loss(logp, logp - 0.1, adv, mask, ref, knobs=LossKnobs(beta=0.1))
    assert loss.dtype == torch.float64
    for key, value in stats.items():
        assert value.dtype == torch.float64, key
    # nothing counted: the ratio statistics read 1 (no movement), the clip fractions 0
    _, empty = policy_loss(logp, logp - 0.1, adv, torch.zeros(1, 2, dtype=torch.bool))
    for key in ("ratio/min", "ratio/mean", "ratio/max"):
        assert empty[key].dtype == torch.float64 and float(empty[key]) == 1.0, key
    assert float(empty["clip_frac/low"]) == 0.0 and float(empty["clip_frac/high"]) == 0.0


def test_entropy_coef_without_entropy_names_the_function_and_the_argument() -> None:
    logp = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(
        ValueError,
        match=r"^policy_loss: entropy_coef needs the tokens' entropy \(entropy=\.\.\.\)$",
    ):
        policy_loss(logp, logp, torch.tensor([1.0]), mask, knobs=LossKnobs(entropy_coef=0.01))
