"""The advantage estimators (RLOO, REINFORCE++, GDPO), per-token advantages in the loss and the
entropy bonus, on hand-computed examples and against slow loops."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm import (
    LossKnobs,
    adapted_entropy_coef,
    batch_normalize,
    decoupled_advantages,
    group_advantages,
    leave_one_out_advantages,
    offpolicy_sequence_mask,
    policy_loss,
    reinforce_pp_advantages,
    token_returns,
)

# --------------------------------------------------------------------------------------- RLOO


def test_rloo_worked_example() -> None:
    # rewards 1,0,1,0: a 1 is compared with the mean of the other three, 1/3 -> +2/3; a 0 with
    # 2/3 -> -2/3 (GRPO gives +-1: the group std 0.5 divides, RLOO does not scale)
    adv = leave_one_out_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4)
    assert torch.allclose(adv, torch.tensor([2 / 3, -2 / 3, 2 / 3, -2 / 3]), atol=1e-6)
    # with scale "group" the rewards' std (0.5) divides too: +-4/3
    scaled = leave_one_out_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, scale="group")
    assert torch.allclose(scaled, torch.tensor([4 / 3, -4 / 3, 4 / 3, -4 / 3]), atol=1e-6)


def test_rloo_against_a_slow_loop() -> None:
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(4 * 3, generator=gen)
    expected = []
    for g in range(4):
        group = rewards[g * 3 : (g + 1) * 3].tolist()
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            expected.append(r - sum(others) / len(others))
    got = leave_one_out_advantages(rewards, 3)
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6)
    # batch scale divides by the whole batch's population std of the rewards
    batch = leave_one_out_advantages(rewards, 3, scale="batch", eps=0.0)
    assert torch.allclose(batch, got / rewards.std(unbiased=False), atol=1e-6)


def test_rloo_of_a_zero_variance_group_is_zero() -> None:
    adv = leave_one_out_advantages(torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 0.5]), 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    # second group: 1 - (0 + 0.5)/2 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0
    assert torch.allclose(adv[3:], torch.tensor([0.75, -0.75, 0.0]), atol=1e-6)


# --------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_worked_example_without_kl() -> None:
    # one group or not, REINFORCE++ normalises over the batch's tokens: rewards 1,0,1,0 with
    # equal lengths give mean 0.5, std 0.5 -> +1,-1,+1,-1 on every token
    mask = torch.ones(4, 3, dtype=torch.bool)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), mask)
    want = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 3)
    assert torch.allclose(adv, want, atol=1e-6)


def test_reinforce_pp_worked_example_with_kl() -> None:
    # two completions of 2 and 1 counted tokens, rewards 1 and 0, beta 0.2, kl per token
    # [[0.5, 0.25], [1.0, -]]. Token rewards: row 0: -0.1, -0.05 + 1 = 0.95; row 1: -0.2 + 0.
    # Returns: row 0: 0.85, 0.95; row 1: -0.2. Over the 3 counted tokens: mean 1.6/3 = 0.5333,
    # var 0.270556 -> (0.85 - 0.5333)/0.520150 = 0.608799, 0.801052, -1.409851
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[True, True], [True, False]])
    kl = torch.tensor([[0.5, 0.25], [1.0, 99.0]])  # 99: not counted, no effect
    adv = reinforce_pp_advantages(rewards, mask, kl, beta=0.2)
    want = torch.tensor([[0.608799, 0.801052], [-1.409851, 0.0]])
    assert torch.allclose(adv, want, atol=1e-6)
    returns = token_returns(rewards, mask, -0.2 * kl)
    assert torch.allclose(returns, torch.tensor([[0.85, 0.95], [-0.2, 0.0]], dtype=torch.float64))


def test_reinforce_pp_with_beta_zero_is_the_length_weighted_batch_normalised_reward() -> None:
    # rewards 1 and 0 over 2 and 1 tokens: the token mean is 2/3, var 2/9 -> +0.7071 on both
    # tokens of the first, -1.4142 on the second's (a kl given with beta 0 changes nothing)
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[True, True], [True, False]])
    adv = reinforce_pp_advantages(rewards, mask, torch.full((2, 2), 3.0), beta=0.0)
    assert torch.allclose(adv, torch.tensor([[0.707107, 0.707107], [-1.414214, 0.0]]), atol=1e-6)
    per_completion = batch_normalize(rewards, mask.sum(dim=1))
    assert torch.allclose(adv[:, 0], per_completion, atol=1e-6)


def test_reinforce_pp_against_a_slow_loop() -> None:
    # rows with holes in the mask (tool tokens of a multi-turn rollout) and a row with no
    # counted token at all (a truncated completion left out of the loss)
    gen = torch.Generator().manual_seed(11)
    n, t, beta = 5, 6, 0.3
    rewards = torch.randn(n, generator=gen)
    kl = torch.rand(n, t, generator=gen)
    mask = torch.rand(n, t, generator=gen) > 0.3
    mask[2] = False
    returns: list[list[float]] = []
    for i in range(n):
        counted = [s for s in range(t) if mask[i, s]]
        row = [0.0] * t
        for s in counted:
            later = [u for u in counted if u >= s]
            row[s] = sum(-beta * float(kl[i, u]) for u in later) + float(rewards[i])
        returns.append(row)
    values = [returns[i][s] for i in range(n) for s in range(t) if mask[i, s]]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values) + 1e-8)
    want = torch.tensor(
        [[(returns[i][s] - mean) / std if mask[i, s] else 0.0 for s in range(t)] for i in range(n)]
    )
    got = reinforce_pp_advantages(rewards, mask, kl, beta=beta)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(got[2], torch.zeros(t))


def test_reinforce_pp_folds_the_kl_only_with_both_a_kl_and_a_beta() -> None:
    # beta defaults to 0: a kl alone is not folded in; a beta with no kl has nothing to fold.
    # Either way: the length-weighted batch-normalised rewards of the beta-0 case
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[True, True], [True, False]])
    plain = reinforce_pp_advantages(rewards, mask)
    assert torch.allclose(plain, torch.tensor([[0.707107, 0.707107], [-1.414214, 0.0]]), atol=1e-6)
    assert torch.equal(reinforce_pp_advantages(rewards, mask, torch.full((2, 2), 3.0)), plain)
    assert torch.equal(reinforce_pp_advantages(rewards, mask, None, beta=0.5), plain)


def test_reinforce_pp_normalises_with_the_eps_given() -> None:
    # rewards 1 and 0 over one token each: mean 0.5, var 0.25; eps 1 -> +-0.5 / sqrt(1.25)
    adv = reinforce_pp_advantages(
        torch.tensor([1.0, 0.0]), torch.ones(2, 1, dtype=torch.bool), eps=1.0
    )
    assert torch.allclose(adv, torch.tensor([[0.447214], [-0.447214]]), atol=1e-6)


def test_batch_normalize_weights_and_the_empty_batch() -> None:
    # values 1, 3 weighted 3, 1: mean 1.5, var (3 * 0.25 + 2.25) / 4 = 0.75
    got = batch_normalize(torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0]), eps=0.0)
    assert torch.allclose(got, torch.tensor([-0.5, 1.5]) / math.sqrt(0.75), atol=1e-6)
    assert torch.equal(batch_normalize(torch.ones(2), torch.zeros(2)), torch.zeros(2))


def test_batch_normalize_weights_are_relative() -> None:
    # the weights 3, 1 of the test above scaled to a total of 1 and of 0.4: the same mean and
    # variance, the same result (only a total of 0 leaves nothing to normalise by)
    values = torch.tensor([1.0, 3.0])
    want = torch.tensor([-0.5, 1.5]) / math.sqrt(0.75)
    for weights in ([0.75, 0.25], [0.3, 0.1]):
        got = batch_normalize(values, torch.tensor(weights), eps=0.0)
        assert torch.allclose(got, want, atol=1e-6)


def test_batch_normalize_of_equal_values_is_zero() -> None:
    # no spread: every value is its mean, and eps inside the root keeps 0 / 0 away -> zeros
    assert torch.equal(batch_normalize(torch.full((4,), 0.7)), torch.zeros(4))
    flat = batch_normalize(torch.full((2, 3), -2.0), torch.tensor([[1.0, 1.0, 0.0]] * 2))
    assert torch.equal(flat, torch.zeros(2, 3))


# --------------------------------------------------------------------------------------- GDPO


def test_gdpo_keeps_apart_what_a_normalised_total_collapses() -> None:
    # two groups of 2, two functions of weight 1. Group A: f1 = [1, 0], f2 = [0, 0] (totals 1, 0);
    # group B: f1 = [1, 0], f2 = [1, 0] (totals 2, 0). GRPO on the totals: +-1 in both groups.
    # GDPO: A's functions normalise to [1, -1] and [0, 0] -> [1, -1]; B's to [1, -1] twice ->
    # [2, -2]; over the batch [1, -1, 2, -2]: mean 0, var 2.5 -> [0.6325, -0.6325, 1.2649, -1.2649]
    scores = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    weights = torch.tensor([1.0, 1.0])
    grpo = group_advantages(scores.sum(dim=1), 2)
    assert torch.allclose(grpo, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-6)
    gdpo = decoupled_advantages(scores, weights, 2)
    assert torch.allclose(gdpo, torch.tensor([0.632456, -0.632456, 1.264911, -1.264911]), atol=1e-6)


def test_gdpo_against_a_slow_loop_with_weights_and_none() -> None:
    gen = torch.Generator().manual_seed(5)
    scores = torch.rand(3 * 4, 3, generator=gen)
    scores[1, 2] = scores[6, 0] = math.nan  # a function that did not apply: counted as 0
    weights = torch.tensor([1.0, 0.5, 2.0])
    combined = []
    for i in range(12):
        g = i // 4
        total = 0.0
        for k in range(3):
            group = [0.0 if math.isnan(x) else x for x in scores[g * 4 : g * 4 + 4, k].tolist()]
            mu = sum(group) / 4
            sigma = math.sqrt(sum((x - mu) ** 2 for x in group) / 4 + 1e-8)
            total += float(weights[k]) * (group[i % 4] - mu) / sigma
        combined.append(total)
    mean = sum(combined) / 12
    std = math.sqrt(sum((c - mean) ** 2 for c in combined) / 12 + 1e-8)
    want = torch.tensor([(c - mean) / std for c in combined])
    assert torch.allclose(decoupled_advantages(scores, weights, 4), want, atol=1e-5)
    # per function with leave-one-out baselines instead: each function's RLOO advantages
    loo = decoupled_advantages(scores, weights, 4, estimator="rloo", scale="none")
    parts = torch.stack(
        [leave_one_out_advantages(scores[:, k].nan_to_num(0.0), 4) for k in range(3)], dim=1
    )
    assert torch.allclose(loo, batch_normalize((parts * weights).sum(dim=1)), atol=1e-5)


def test_gdpo_uses_the_eps_given_in_both_normalisations() -> None:
    # the example above with eps 1: each group's [1, 0] normalises to +-0.5 / sqrt(0.25 + 1) =
    # +-1/sqrt(5), so the weighted sums are [1, -1, 2, -2] / sqrt(5), of variance 0.5; over the
    # batch / sqrt(0.5 + 1): [1, -1, 2, -2] / sqrt(7.5). (eps 1e-8 in either place gives
    # [1, -1, 2, -2] / sqrt(3.5) or / sqrt(2.5) instead)
    scores = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    gdpo = decoupled_advantages(scores, torch.tensor([1.0, 1.0]), 2, eps=1.0)
    want = torch.tensor([1.0, -1.0, 2.0, -2.0]) / math.sqrt(7.5)
    assert torch.allclose(gdpo, want, atol=1e-6)


# --------------------------------------------------------------------------------------- loss


def _loss(advantages: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, _ = policy_loss(logp, logp.detach(), advantages, mask, knobs=LossKnobs(**kwargs))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def test_per_token_advantages_weight_each_token() -> None:
    # ratio 1 (on-policy): the grpo loss is -mean over sequences of each sequence's mean A_t:
    # row 0 (2 tokens): -(2 + 1)/2 = -1.5; row 1 (3 tokens): -(1 - 1 + 3)/3 = -1 -> -1.25.
    # Its gradient on logp_t is -A_t / |o_i| / N: row 0 -> -0.5, -0.25; row 1 -> -1/6, 1/6, -0.5
    per_token = torch.tensor([[2.0, 1.0, 7.0], [1.0, -1.0, 3.0]])  # 7: not counted
    loss, grad = _loss(per_token)
    assert torch.allclose(loss, torch.tensor(-1.25), atol=1e-6)
    want = torch.tensor([[-0.5, -0.25, 0.0], [-1 / 6, 1 / 6, -0.5]])
    assert torch.allclose(grad, want, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_a_per_completion_advantage_equals_its_broadcast(loss_type: str) -> None:
    # [N] advantages are today's path; [N, T] filled with them is the same loss and gradient,
    # bit for bit
    adv = torch.tensor([0.7, -1.3])
    one = _loss(adv, loss_type=loss_type, dual_clip=2.0)
    broadcast = _loss(adv[:, None].expand(2, 3).clone(), loss_type=loss_type, dual_clip=2.0)
    assert torch.equal(one[0], broadcast[0]) and torch.equal(one[1], broadcast[1])


def test_the_entropy_bonus_is_subtracted_with_the_losss_aggregation() -> None:
    # entropies [[1, 2, -], [0.5, 0.5, 2]], coef 0.1, advantages 0: grpo averages each
    # sequence's tokens, then the sequences: (1.5 + 1) / 2 = 1.25 -> loss -0.125; each counted
    # entropy's gradient is -coef / |o_i| / N: row 0 -> -0.025, row 1 -> -1/60
    entropy = torch.tensor([[1.0, 2.0, math.nan], [0.5, 0.5, 2.0]], requires_grad=True)
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, _ = policy_loss(
        logp,
        logp.detach(),
        torch.zeros(2),
        mask,
        knobs=LossKnobs(entropy_coef=0.1),
        entropy=entropy,
    )
    assert torch.allclose(loss, torch.tensor(-0.125), atol=1e-6)
    (grad,) = torch.autograd.grad(loss, entropy)
    assert torch.allclose(grad, torch.tensor([[-0.025, -0.025, 0.0], [-1 / 60] * 3]), atol=1e-6)
    # dapo: the token mean over the step's 5 counted tokens: (1 + 2 + 0.5 + 0.5 + 2)/5 = 1.2
    dapo, _ = policy_loss(
        logp,
        logp.detach(),
        torch.zeros(2),
        mask,
        knobs=LossKnobs(entropy_coef=0.1, loss_type="dapo"),
        entropy=entropy,
    )
    assert torch.allclose(dapo, torch.tensor(-0.12), atol=1e-6)
    with pytest.raises(ValueError, match="entropy_coef needs the tokens' entropy"):
        policy_loss(logp, logp.detach(), torch.zeros(2), mask, knobs=LossKnobs(entropy_coef=0.1))


def test_a_zero_entropy_coef_leaves_the_loss_as_it_was() -> None:
    gen = torch.Generator().manual_seed(2)
    logp = torch.randn(3, 4, generator=gen)
    mask = torch.rand(3, 4, generator=gen) > 0.2
    args = (logp, logp - 0.1, torch.tensor([1.0, -0.5, 0.2]), mask)
    plain, _ = policy_loss(*args)
    with_zero, _ = policy_loss(
        *args, knobs=LossKnobs(entropy_coef=0.0), entropy=torch.full((3, 4), math.nan)
    )
    assert torch.equal(plain, with_zero)


# --------------------------------------------------------------------------------------- coef


def test_the_entropy_coefficient_moves_towards_the_target() -> None:
    # below the target: one step up; above: one step down, never below 0; at it or unmeasured:
    # unchanged
    assert adapted_entropy_coef(0.01, 0.1, 0.2, 0.005) == pytest.approx(0.015, abs=1e-12)
    assert adapted_entropy_coef(0.01, 0.3, 0.2, 0.005) == pytest.approx(0.005, abs=1e-12)
    assert adapted_entropy_coef(0.003, 0.3, 0.2, 0.005) == 0.0
    assert adapted_entropy_coef(0.0, 0.1, 0.2, 0.005) == pytest.approx(0.005, abs=1e-12)
    assert adapted_entropy_coef(0.01, 0.2, 0.2, 0.005) == 0.01
    assert adapted_entropy_coef(0.01, math.nan, 0.2, 0.005) == 0.01


def test_offpolicy_masking_takes_a_completions_sign_from_its_per_token_advantages() -> None:
    # both completions drifted (behaviour - current = 0.5 per token > delta 0.1); the first's
    # per-token advantages average -0.5 over its counted tokens (the 9 is not counted), the
    # second's +0.5: only the first is dropped, as with [N] advantages of those means
    logp = torch.zeros(2, 3)
    behaviour = torch.full((2, 3), 0.5)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    per_token = torch.tensor([[-2.0, 1.0, 9.0], [1.5, -1.0, 1.0]])
    kept = offpolicy_sequence_mask(logp, behaviour, per_token, mask, 0.1)
    assert kept.tolist() == [False, True]
    means = offpolicy_sequence_mask(logp, behaviour, torch.tensor([-0.5, 0.5]), mask, 0.1)
    assert torch.equal(kept, means)
