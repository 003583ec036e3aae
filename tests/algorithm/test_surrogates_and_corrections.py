"""CISPO, SAPO and the sampler/trainer corrections on hand-computed examples (values and
gradients), in the style of the seed's worked example: rewards 1,0,1,0 give A = +1,-1,+1,-1."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm import (
    LossKnobs,
    Normalizer,
    group_advantages,
    importance_weights,
    offpolicy_sequence_mask,
    policy_loss,
)

ADV = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4)  # +1, -1, +1, -1
ONE_TOKEN = torch.ones(4, 1, dtype=torch.bool)


def one_token_loss(ratios: list[float], **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Four completions of one token each, old log-prob 0, so logp = ln(ratio): loss, d loss /
    d logp [4] and the statistics."""
    logp = torch.log(torch.tensor(ratios))[:, None].requires_grad_(True)  # [4, 1]
    loss, stats = policy_loss(logp, torch.zeros(4, 1), ADV, ONE_TOKEN, knobs=LossKnobs(**kw))
    loss.backward()
    return loss.detach(), logp.grad.flatten(), stats


# ----------------------------------------------------------------------------------------- CISPO


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient() -> None:
    # ratios 2, 0.5, 6, 1; cispo_clip_high 4 -> weights w = 2, 0.5, 5 (clipped), 1
    # loss per token -w * A * logp: -2 ln 2 = -1.386294; -0.5 * -1 * ln 0.5 = -0.346574;
    # -5 ln 6 = -8.958797; -1 * -1 * ln 1 = 0. Token mean over the 4 tokens: -2.672916
    loss, grad, stats = one_token_loss([2.0, 0.5, 6.0, 1.0], loss_type="cispo", cispo_clip_high=4)
    assert float(loss) == pytest.approx(-2.672916, abs=1e-6)
    # stop-gradient: d/dlogp = -w * A / 4 = -0.5, 0.125, -1.25, 0.25. The clipped token (ratio 6)
    # keeps a gradient of weight 5, where the PPO clip would give it none; without the
    # stop-gradient the first would be -A (r ln r + r) / 4 = -(2 ln 2 + 2) / 4 = -0.846574
    assert torch.allclose(grad, torch.tensor([-0.5, 0.125, -1.25, 0.25]), atol=1e-6)
    assert float(stats["clip_frac/high"]) == pytest.approx(0.25)  # the ratio 6 only
    assert float(stats["clip_frac/low"]) == 0  # no lower bound by default


def test_cispo_lower_bound() -> None:
    # cispo_clip_low 0.2: the ratio 0.5 is raised to the weight 0.8 -> gradient 0.8 / 4 = 0.2,
    # and its loss becomes -0.8 * -1 * ln 0.5 = -0.554518 (sum -10.899609, mean -2.724902)
    loss, grad, stats = one_token_loss(
        [2.0, 0.5, 6.0, 1.0], loss_type="cispo", cispo_clip_low=0.2, cispo_clip_high=4
    )
    assert float(loss) == pytest.approx(-2.724902, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([-0.5, 0.2, -1.25, 0.25]), atol=1e-6)
    assert float(stats["clip_frac/low"]) == pytest.approx(0.25)


def test_cispo_aggregates_by_the_steps_tokens() -> None:
    # lengths 2 and 3, A = 2, -1, on-policy (weight 1), every logp ln 0.5: the first's tokens
    # -2 * ln 0.5 = 1.386294 (x2), the second's -(-1) * ln 0.5 = -0.693147 (x3);
    # sum 0.693147 over the step's 5 tokens = 0.138629 (a per-sequence mean would give
    # (1.386294 - 0.693147) / 2 = 0.346574); gradient -A / 5 = -0.4 and 0.2
    mask = torch.tensor([[True, True, False], [True, True, True]])
    logp = torch.full((2, 3), math.log(0.5), requires_grad=True)
    loss, _ = policy_loss(
        logp,
        logp.detach(),
        torch.tensor([2.0, -1.0]),
        mask,
        knobs=LossKnobs(loss_type="cispo"),
        normalizer=Normalizer(num_sequences=2, num_tokens=5.0),
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.138629, abs=1e-6)
    assert torch.allclose(logp.grad, torch.tensor([[-0.4, -0.4, 0.0], [0.2, 0.2, 0.2]]))


# ----------------------------------------------------------------------------------------- SAPO


def test_sapo_soft_gate_by_hand() -> None:
    # gate f(r) = sigmoid(tau (r - 1)) * 4 / tau, loss -f(r) * A; tau_pos 2, tau_neg 4 and ratios
    # that make sigmoid 1/2 or sigmoid(+-ln 3) = 3/4, 1/4:
    #   A=+1, r=1:              s = 1/2,  f = 1/2 * 2 = 1     -> -1
    #   A=-1, r=1 - ln3/4:      s = 1/4,  f = 1/4 * 1 = 0.25  -> +0.25
    #   A=+1, r=1 + ln3/2:      s = 3/4,  f = 3/4 * 2 = 1.5   -> -1.5
    #   A=-1, r=1:              s = 1/2,  f = 1/2 * 1 = 0.5   -> +0.5
    # per-sequence mean over 4 one-token completions: (-1 + 0.25 - 1.5 + 0.5) / 4 = -0.4375
    ratios = [1.0, 1 - math.log(3) / 4, 1 + math.log(3) / 2, 1.0]
    loss, grad, stats = one_token_loss(ratios, loss_type="sapo", sapo_tau_pos=2, sapo_tau_neg=4)
    assert float(loss) == pytest.approx(-0.4375, abs=1e-6)
    # d/dlogp = -A * f'(r) * r / 4 with f'(r) = 4 s (1 - s): 1, 0.75, 0.75, 1
    #   -1 * 1 / 4 = -0.25; 0.75 * 0.725347 / 4 = 0.136003; -0.75 * 1.549306 / 4 = -0.290495;
    #   1 / 4 = 0.25. The third ratio (1.55) is past any PPO clip; the gate only damps it
    expected = torch.tensor([-0.25, 0.136003, -0.290495, 0.25])
    assert torch.allclose(grad, expected, atol=1e-6)
    assert "clip_frac/low" not in stats and "clip_frac/high" not in stats  # nothing is clipped


def test_sapo_on_policy_gradient_is_grpos_at_any_temperature() -> None:
    # at r = 1 the gate's slope 4 s (1 - s) is 1 for every tau: the plain policy gradient
    # -A / (G |o_i|), as the clipped surrogate's
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = torch.tensor([2.0, -1.0])
    grads = []
    for kw in (
        {"loss_type": "grpo"},
        {"loss_type": "sapo"},
        {"loss_type": "sapo", "sapo_tau_neg": 9.0},
    ):
        logp = torch.zeros(2, 3, requires_grad=True)
        policy_loss(logp, torch.zeros(2, 3), adv, mask, knobs=LossKnobs(**kw))[0].backward()
        grads.append(logp.grad)
    expected = torch.tensor([[-0.5, -0.5, 0.0], [1 / 6, 1 / 6, 1 / 6]])
    for grad in grads:
        assert torch.allclose(grad, expected, atol=1e-6)


def test_dual_clip_is_refused_without_a_clipped_surrogate() -> None:
    with pytest.raises(ValueError, match="dual_clip bounds the clipped surrogate"):
        one_token_loss([1.0] * 4, loss_type="sapo", dual_clip=2.0)


# --------------------------------------------------------------------------- importance weights
#
# Two completions: the first's tokens have pi_old / pi_sampler = 2 and 0.5 (geometric mean 1),
# the second's 4 and 4 (geometric mean 4); a masked third slot holds garbage.

OLD = torch.log(torch.tensor([[0.8, 0.2, 0.5], [0.8, 0.4, 0.3]]))
SAMPLER = torch.log(torch.tensor([[0.4, 0.4, 1.0], [0.2, 0.1, 1.0]]))
SAMPLER[:, 2] = float("inf")
MASK = torch.tensor([[True, True, False], [True, True, False]])


def weights_of(**kw) -> tuple[torch.Tensor, dict]:
    weights, stats = importance_weights(OLD, SAMPLER, MASK, **kw)
    return weights[MASK].view(2, 2), {k: float(v) for k, v in stats.items()}


def test_token_level_truncate_and_mask() -> None:
    # truncate at 3: 2, 0.5, 3 (4 cut), 3 (4 cut) -> 2 of 4 tokens truncated
    w, stats = weights_of(cap=3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5], [3.0, 3.0]]), atol=1e-6)
    assert stats == pytest.approx({"truncated_frac": 0.5, "masked_frac": 0.0})
    # mask outside [0.6, 3]: the 0.5 and both 4s drop to 0, the 2 keeps its weight
    w, stats = weights_of(cap=3.0, low=0.6, mode="mask")
    assert torch.allclose(w, torch.tensor([[2.0, 0.0], [0.0, 0.0]]), atol=1e-6)
    assert stats == pytest.approx({"truncated_frac": 0.0, "masked_frac": 0.75})


def test_sequence_level_weights_are_the_geometric_mean() -> None:
    # sequence weights 1 (= sqrt(2 * 0.5)) and 4, the masked slot ignored
    w, stats = weights_of(cap=3.0, level="sequence")
    assert torch.allclose(w, torch.tensor([[1.0, 1.0], [3.0, 3.0]]), atol=1e-6)
    assert stats["truncated_frac"] == pytest.approx(0.5)  # the second sequence's 2 tokens
    w, stats = weights_of(cap=3.0, level="sequence", mode="mask")
    assert torch.allclose(w, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), atol=1e-6)
    assert stats["masked_frac"] == pytest.approx(0.5)
    # a lower bound alone drops the first sequence (1 < 1.5) and keeps the second's 4
    w, _ = weights_of(cap=None, low=1.5, level="sequence", mode="mask")
    assert torch.allclose(w, torch.tensor([[0.0, 0.0], [4.0, 4.0]]), atol=1e-6)


def test_truncation_has_no_lower_bound() -> None:
    with pytest.raises(ValueError, match="a lower bound only masks"):
        weights_of(cap=3.0, low=0.5)


# ------------------------------------------------------------------------- off-policy masking


def test_offpolicy_sequence_mask_drops_far_negative_samples_only() -> None:
    # A = +1, -1, +1, -1; per-token log pi_behaviour - log pi_current and their means:
    #   [1, 1] -> 1 (A > 0: kept however far);  [1.5, 0.5] -> 1 > 0.5 (A < 0: dropped)
    #   [0, 0] -> 0 (kept);  [1, 0] -> 0.5, not above 0.5 (kept); the masked slot's 9 is ignored
    current = torch.zeros(4, 3)
    behaviour = torch.tensor([[1.0, 1.0, 9], [1.5, 0.5, 9], [0.0, 0.0, 9], [1.0, 0.0, 9]])
    mask = torch.tensor([[True, True, False]] * 4)
    keep = offpolicy_sequence_mask(current, behaviour, ADV, mask, delta=0.5)
    assert keep.tolist() == [True, False, True, True]


def test_a_dropped_sequence_counts_as_zeros() -> None:
    # on-policy, grpo: per-sequence losses -A = -1, +1, -1, +1; the second dropped (weight 0)
    # still counts among the 4 sequences: (-1 + 0 - 1 + 1) / 4 = -0.25; its gradient is 0
    weights = torch.tensor([1.0, 0.0, 1.0, 1.0])[:, None]
    logp = torch.zeros(4, 1, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(4, 1), ADV, ONE_TOKEN, importance_weights=weights)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.25, abs=1e-6)
    assert torch.allclose(logp.grad.flatten(), torch.tensor([-0.25, 0.0, -0.25, 0.25]))


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_a_nan_weight_is_masked_and_counted_in_either_mode(mode: str) -> None:
    # a NaN sampler log-prob would pass clamp and the bound checks into the loss
    old = torch.zeros(1, 3)
    sampler = torch.tensor([[0.0, math.nan, 0.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    low = 0.5 if mode == "mask" else None
    weights, stats = importance_weights(old, sampler, mask, cap=2.0, low=low, mode=mode)
    assert weights.tolist() == [[1.0, 0.0, 1.0]]
    assert float(stats["masked_frac"]) == pytest.approx(1 / 3)
