"""The GRPO family's math, as pure functions of tensors.

Implemented (names follow the papers):
- group-relative advantages (DeepSeekMath): ``A_i = (r_i - mean(r)) / sqrt(var(r) + eps)`` over each
  contiguous block of G completions, with the population variance and ``eps`` inside the root;
  scaling by the batch std (as TRL's ``scale_rewards="batch"``) or no scaling (Dr. GRPO) as options;
- the other estimators: leave-one-out baselines (RLOO), REINFORCE++'s returns of KL-shaped token
  rewards normalised over the batch's tokens (per-token advantages), and GDPO's group
  normalisation of each reward function before their weighted sum, then over the batch;
- the KL estimators k1, k2, k3 of Schulman's note, k3 being the seed's
  ``exp(ref - logp) - (ref - logp) - 1``;
- the clipped surrogate with separate low/high clip ranges (DAPO), an optional dual clip for negative
  advantages (Ye et al., 2020), token or sequence-level ratios (GSPO), and optional per-token
  importance weights for off-policy rollouts (truncated importance sampling);
- the loss aggregations ``grpo``, ``bnpo``, ``dapo`` and ``dr_grpo`` as small functions in a dict;
- the per-token surrogates ``clip`` (above), ``cispo`` (MiniMax-M1's clipped, stop-gradient
  importance weight on ``log pi``) and ``sapo`` (SAPO's soft sigmoid gate), each loss_type
  pairing one with an aggregation;
- the stability controls: zero-variance group detection (DAPO's dynamic sampling), importance
  weights against the sampler's log-probs (truncated or masked, per token or per sequence; Yao
  et al., 2025), off-policy sequence masking (DeepSeek-V3.2) and the log-prob mismatch,
  the high-entropy token mask (Wang et al., 2025, "Beyond the 80/20 rule"), and the soft parameter
  update used to refresh the reference policy;
- the entropy bonus (``-coef * H`` per counted token) and the rule that moves its coefficient
  towards a target entropy (Skywork-OR1).

Shapes: ``N`` completions, ``T`` completion tokens (right padded). ``loss_mask`` is True where a
token counts. This module imports only torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# --------------------------------------------------------------------------------------- advantages


def _group_view(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.view(-1, group_size)  # [P, G]


def group_std(rewards: Tensor, group_size: int) -> Tensor:
    """Population std of each group, without eps: [N] -> [P]."""
    return _group_view(rewards, group_size).std(dim=1, unbiased=False)


def zero_std_groups(rewards: Tensor, group_size: int, atol: float = 1e-6) -> Tensor:
    """Groups whose rewards are all equal (population std <= atol): [N] -> [P] bool.

    Such a group has zero advantage for every completion, so it adds no policy gradient.
    """
    return group_std(rewards, group_size) <= atol


def _reward_scale(centred: Tensor, rewards: Tensor, scale: str, eps: float) -> Tensor:
    """The divisor ``scale_rewards`` names. centred: [P, G] float64 rewards less their group's
    mean; rewards: [N]. Returns each group's ``sqrt(var + eps)`` [P, 1], the batch's, or 1."""
    if scale == "group":
        return (centred.pow(2).mean(dim=1, keepdim=True) + eps).sqrt()  # [P, 1]
    if scale == "batch":
        flat = rewards.double()
        return ((flat - flat.mean()).pow(2).mean() + eps).sqrt()
    if scale == "none":
        return torch.ones((), dtype=torch.float64)
    raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-8
) -> Tensor:
    """Group-relative advantages. rewards: [N] (N = P*G, groups contiguous) -> [N].

    scale: "group" divides by each group's ``sqrt(var + eps)`` (the seed's formula), "batch" by the
    whole batch's, "none" only centres (Dr. GRPO). A zero-variance group gives exactly 0.
    """
    grouped = _group_view(rewards.double(), group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    denom = _reward_scale(centred, rewards, scale, eps)
    return (centred / denom).reshape(-1).to(rewards.dtype)


def leave_one_out_advantages(
    rewards: Tensor, group_size: int, scale: str = "none", eps: float = 1e-8
) -> Tensor:
    """RLOO (Kool et al., 2019; Ahmadian et al., 2024): ``A_i = r_i - mean_{j != i} r_j`` within
    each group, which is ``G / (G - 1) * (r_i - mean(r))``. rewards: [N] -> [N].

    scale divides as in ``group_advantages`` (by the rewards' std, not the advantages'); RLOO
    itself does not scale, so a config that leaves ``scale_rewards`` unset resolves it to "none".
    """
    grouped = _group_view(rewards.double(), group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    # r_i - (sum - r_i) / (G - 1) = (G r_i - sum) / (G - 1) = G / (G - 1) * (r_i - mean)
    loo = centred * (group_size / (group_size - 1))  # [P, G]
    return (loo / _reward_scale(centred, rewards, scale, eps)).reshape(-1).to(rewards.dtype)


# estimator -> advantages of one reward per completion: (rewards [N], group_size, scale, eps) -> [N]
ESTIMATORS: dict[str, Callable[[Tensor, int, str, float], Tensor]] = {
    "grpo": group_advantages,
    "rloo": leave_one_out_advantages,
}


def batch_normalize(values: Tensor, weights: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)``, the mean and population variance over the whole batch,
    each value weighted by ``weights`` (same shape; 0 leaves a value out of the statistics;
    default: each value once). Any shape; float64 inside, the values' dtype out. With nothing
    weighted there is nothing to normalise by: zeros."""
    x = values.double()
    w = torch.ones_like(x) if weights is None else weights.double()
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(values)
    mean = (x * w).sum() / total
    var = ((x - mean).pow(2) * w).sum() / total
    return ((x - mean) / (var + eps).sqrt()).to(values.dtype)


def decoupled_advantages(
    per_function: Tensor,
    weights: Tensor,
    group_size: int,
    estimator: str = "grpo",
    scale: str = "group",
    eps: float = 1e-8,
) -> Tensor:
    """GDPO (Liu et al., 2026, arXiv 2601.05242): each reward function's advantages within its
    groups separately, their weighted sum, then normalised over the batch.

    per_function: [N, K] scores, NaN where a function returned None (counted as 0, as in the
    weighted total); weights: [K]. ``A_k = ESTIMATORS[estimator](r_k)`` per function (the
    paper's: grpo with the group std), ``A = sum_k w_k A_k``; returns ``batch_normalize(A)``
    [N], each completion counted once. Normalising each function alone keeps apart reward
    combinations that one normalised total maps to the same advantage.
    """
    scores = torch.nan_to_num(per_function.double(), nan=0.0)  # [N, K]
    per = [
        ESTIMATORS[estimator](scores[:, k], group_size, scale, eps) for k in range(scores.shape[1])
    ]
    combined = (torch.stack(per, dim=1) * weights.double()).sum(dim=1)  # [N]
    return batch_normalize(combined, eps=eps).to(per_function.dtype)


def token_returns(rewards: Tensor, loss_mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """Undiscounted returns ``G_t = sum_{s >= t} r_s`` of each completion, where ``r_s`` is
    ``token_rewards`` (or 0) at counted tokens plus the sequence reward at the last counted
    token. rewards: [N]; loss_mask, token_rewards: [N, T] -> [N, T] float64 (0 where not
    counted). A completion with no counted token gets no return."""
    mask = loss_mask.bool()
    returns = per_token_rewards(rewards, mask, token_rewards).flip(1).cumsum(dim=1).flip(1)
    return torch.where(mask, returns, torch.zeros_like(returns))


def reinforce_pp_advantages(
    rewards: Tensor,
    loss_mask: Tensor,
    kl: Tensor | None = None,
    beta: float = 0.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ (Hu, 2025, arXiv 2501.03262): the KL to the reference folded into the token
    rewards, ``r_t = -beta * kl_t`` at every counted token plus the sequence reward at the last,
    returns ``G_t = sum_{s >= t} r_s``, then normalised over every counted token of the batch.

    rewards: [N]; loss_mask, kl: [N, T] (kl of the proximal policy to the reference). Returns
    [N, T] in the rewards' dtype, 0 where not counted. With beta 0 every token of completion i
    gets ``(r_i - m) / sqrt(v + eps)``, m and v the rewards' mean and variance over the
    counted tokens (each completion weighted by its length).
    """
    shaped = None if kl is None or not beta else -beta * kl.double()
    returns = token_returns(rewards, loss_mask, shaped)  # [N, T]
    mask = loss_mask.bool()
    normalized = batch_normalize(returns, mask, eps)
    return torch.where(mask, normalized, torch.zeros_like(normalized)).to(rewards.dtype)


def per_token_rewards(rewards: Tensor, loss_mask: Tensor, shaped: Tensor | None) -> Tensor:
    """[N, T] float64 per-token rewards: ``shaped`` (e.g. ``-beta * kl``) at counted tokens, plus
    the sequence reward [N] at each completion's last counted token; 0 elsewhere."""
    mask = loss_mask.bool()
    r = torch.zeros(mask.shape, dtype=torch.float64, device=rewards.device)  # [N, T]
    if shaped is not None:
        r = torch.where(mask, shaped.double(), r)
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(dim=1)  # [N] last counted token
    rows = mask.any(dim=1).nonzero().flatten()
    r[rows, last[rows]] += rewards.double()[rows]
    return r


def gae(
    rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over each completion's counted
    tokens: ``delta_t = r_t + gamma V_{t+1} - V_t`` (V after the last counted token is 0),
    ``A_t = delta_t + gamma lam A_{t+1}``; returns ``R_t = A_t + V_t`` (the critic's target).

    rewards, values, loss_mask: [N, T]; a token outside the mask (a tool's output between turns)
    is skipped: the next counted token follows the one before it. Returns ([N, T], [N, T])
    float64, 0 outside the mask. lam 1: ``A_t = G_t - V_t`` with ``G_t`` the discounted return;
    lam 0: the one-step TD error.
    """
    mask = loss_mask.bool()
    r, v = rewards.double(), values.double()
    advantages = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)  # A_{t+1}
    next_value = torch.zeros_like(running)  # V_{t+1}
    for t in reversed(range(r.shape[1])):
        here = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * running
        advantages[:, t] = torch.where(here, step, 0.0)
        running = torch.where(here, step, running)
        next_value = torch.where(here, v[:, t], next_value)
    returns = torch.where(mask, advantages + v, 0.0)
    return advantages, returns


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    clip: float,
    tokens: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: ``0.5 max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old +
    clip(V - V_old, -clip, clip)``, summed over counted tokens and divided by ``tokens`` (the
    step's count, so micro-batches add up to the step's token mean).

    values: [b, T] the critic's now (with grad); old_values: [b, T] its values when the step
    began; returns: [b, T] GAE's targets; loss_mask: [b, T]. Stats: ``clip_frac`` (tokens where
    the clipped term won), over this micro-batch's counted tokens.
    """
    mask = loss_mask.to(values.dtype)
    returns, old_values = returns.to(values.dtype), old_values.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, bounded = (values - returns).pow(2), (clipped - returns).pow(2)
    loss = (0.5 * torch.maximum(plain, bounded) * mask).sum() / tokens
    counted = mask.sum().clamp(min=1)
    return loss, {"clip_frac": ((bounded > plain).to(mask.dtype) * mask).sum().detach() / counted}


# --------------------------------------------------------------------------------------- KL


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log(pi/ref): unbiased, can be negative per token."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """0.5 * log(pi/ref)^2: biased, never negative."""
    return 0.5 * (logp - ref_logp).pow(2)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ref/pi - log(ref/pi) - 1 (the seed's estimator): unbiased, never negative, 0 when equal."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}

# --------------------------------------------------------------------------------------- aggregation


@dataclass(frozen=True)
class Normalizer:
    """Counts over the whole optimizer step, so that micro-batch losses sum to the step's loss.

    num_sequences: completions in the step (all micro-batches, all ranks' share for this rank).
    num_tokens: counted tokens in the step (``dapo``; all-reduced across ranks when distributed).
    num_micro_batches: micro-batches in the step (``bnpo`` averages their token means).
    max_new_tokens: the constant length budget of ``dr_grpo`` (``rollout.max_new_tokens``);
    required by ``dr_grpo``, whose loss it scales.
    """

    num_sequences: float
    num_tokens: float
    num_micro_batches: int = 1
    max_new_tokens: int | None = None


def _seq_mean_then_mean(per_token: Tensor, mask: Tensor, norm: Normalizer) -> Tensor:
    # the seed's 1/G * 1/|o_i|: mean over each completion's tokens, then over completions
    lengths = mask.sum(dim=1).clamp(min=1)  # [N]
    per_seq = (per_token * mask).sum(dim=1) / lengths  # [N]
    return per_seq.sum() / norm.num_sequences


def _micro_batch_token_mean(per_token: Tensor, mask: Tensor, norm: Normalizer) -> Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1) / norm.num_micro_batches


def _step_token_mean(per_token: Tensor, mask: Tensor, norm: Normalizer) -> Tensor:
    return (per_token * mask).sum() / max(norm.num_tokens, 1.0)


def _constant_budget(per_token: Tensor, mask: Tensor, norm: Normalizer) -> Tensor:
    if norm.max_new_tokens is None:
        # a silent default (1, or the batch's longest completion) would rescale the loss
        raise ValueError("loss_type='dr_grpo' needs Normalizer.max_new_tokens (the length budget)")
    return (per_token * mask).sum() / (norm.num_sequences * norm.max_new_tokens)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, Normalizer], Tensor]] = {
    "grpo": _seq_mean_then_mean,
    "bnpo": _micro_batch_token_mean,
    "dapo": _step_token_mean,
    "dr_grpo": _constant_budget,
}

# --------------------------------------------------------------------------------------- ratios


def _token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return logp - old_logp  # [N, T]


def _sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    # GSPO: the length-normalised sequence log-ratio, shared by every token of the completion
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]
    seq = ((logp - old_logp) * mask).sum(dim=1, keepdim=True) / lengths  # [N, 1]
    return seq.expand_as(logp)  # [N, T]


LOG_RATIOS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}

# --------------------------------------------------------------------------------------- surrogates


@dataclass(frozen=True)
class LossKnobs:
    """The policy loss's knobs, one object (the trainer builds it from ``algorithm.*``); each
    surrogate reads only its own. The defaults are a default config's.

    loss_type: a ``LOSS_TYPES`` key, naming the surrogate and the aggregation.
    ratio_level: "token" (one ratio per token) or "sequence" (GSPO's, shared by the completion).
    clip_low, clip_high, dual_clip: the clipped surrogate (PPO, DAPO's asymmetric range).
    cispo_clip_low, cispo_clip_high: CISPO's weight range ``[1 - low, 1 + high]``; low None
    is no lower bound (the paper's choice).
    sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for A > 0 and A <= 0.
    beta, kl_estimator: the in-loss KL penalty ``beta * KL`` (a ``KL_ESTIMATORS`` key); the KL
    is measured whenever the reference's log-probs are given, beta 0 or not.
    entropy_coef: the entropy bonus ``-entropy_coef * H`` per counted token (0: none).
    """

    loss_type: str = "grpo"
    ratio_level: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    cispo_clip_low: float | None = None
    cispo_clip_high: float = 4.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


Surrogate = Callable[[Tensor, Tensor, Tensor, LossKnobs], tuple[Tensor, dict[str, Tensor]]]


def _clipped_surrogate(
    ratio: Tensor, logp: Tensor, adv: Tensor, k: LossKnobs
) -> tuple[Tensor, dict[str, Tensor]]:
    # -min(rho*A, clip(rho, 1-low, 1+high)*A); ratio, logp: [N, T], adv: [N, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - k.clip_low, 1 + k.clip_high) * adv
    per_token = -torch.min(unclipped, clipped)  # [N, T]
    if k.dual_clip is not None:
        # for A < 0 the surrogate is unbounded as ratio grows; cap the loss at -dual_clip * A
        per_token = torch.where(adv < 0, torch.min(per_token, -k.dual_clip * adv), per_token)
    # the tokens whose gradient the clip removed
    low = (ratio < 1 - k.clip_low) & (adv < 0)
    high = (ratio > 1 + k.clip_high) & (adv > 0)
    return per_token, {"clip_frac/low": low, "clip_frac/high": high}


def _cispo_surrogate(
    ratio: Tensor, logp: Tensor, adv: Tensor, k: LossKnobs
) -> tuple[Tensor, dict[str, Tensor]]:
    # MiniMax-M1: -sg(clip(rho, 1-low, 1+high)) * A * logp. The weight is a constant, so every
    # token keeps a gradient (-weight * A * grad logp); the clip only bounds its size
    low = 0.0 if k.cispo_clip_low is None else 1 - k.cispo_clip_low
    high = 1 + k.cispo_clip_high
    weight = ratio.detach().clamp(min=low, max=high)  # [N, T]
    return -weight * adv * logp, {"clip_frac/low": ratio < low, "clip_frac/high": ratio > high}


def _sapo_surrogate(
    ratio: Tensor, logp: Tensor, adv: Tensor, k: LossKnobs
) -> tuple[Tensor, dict[str, Tensor]]:
    # SAPO: -f(rho) * A with the gate f(x) = sigmoid(tau * (x - 1)) * 4 / tau; its slope
    # 4 * s * (1 - s) is 1 at rho = 1 (the plain policy gradient on-policy) and fades smoothly
    # as rho leaves 1, faster for a hotter tau (tau_neg for A <= 0)
    tau = torch.where(adv > 0, k.sapo_tau_pos, k.sapo_tau_neg)  # as adv: [N, 1] or [N, T]
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau  # [N, T]
    return -gate * adv, {}


SURROGATES: dict[str, Surrogate] = {
    "clip": _clipped_surrogate,
    "cispo": _cispo_surrogate,
    "sapo": _sapo_surrogate,
}

# loss_type -> (per-token surrogate, aggregation): each paper's pair
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "grpo"),
    "bnpo": ("clip", "bnpo"),
    "dapo": ("clip", "dapo"),
    "dr_grpo": ("clip", "dr_grpo"),
    "cispo": ("cispo", "dapo"),  # MiniMax-M1 divides by the tokens of the whole batch
    "sapo": ("sapo", "grpo"),  # SAPO: 1/G sum_i 1/|o_i| sum_t
}

# --------------------------------------------------------------------------------------- loss


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _zeroed(values: Tensor, keep: Tensor) -> Tensor:
    # masked positions may hold anything (even inf); zeroed, they reach neither value nor grad
    return torch.where(keep, values, torch.zeros_like(values))


def _token_advantages(advantages: Tensor, keep: Tensor) -> Tensor:
    """[N] -> [N, 1] (shared by the completion's tokens), or [N, T] zeroed where not counted."""
    if advantages.dim() == 1:
        return advantages.unsqueeze(1)  # [N, 1]
    return _zeroed(advantages, keep)  # [N, T]: masked positions may hold anything


def _policy_gradient_term(
    per_token: Tensor, importance_weights: Tensor | None, pg_mask: Tensor | None
) -> Tensor:
    """The surrogate [N, T] times the importance weights, 0 outside ``pg_mask``."""
    if importance_weights is not None:
        per_token = per_token * importance_weights
    if pg_mask is not None:
        per_token = torch.where(pg_mask.bool(), per_token, torch.zeros_like(per_token))
    return per_token


def _with_penalties(
    per_token: Tensor,
    logp: Tensor,
    kl: Tensor | None,
    entropy: Tensor | None,
    keep: Tensor,
    knobs: LossKnobs,
) -> Tensor:
    """``per_token + beta * KL - entropy_coef * H`` [N, T], each term only where its knob is on;
    the entropy's masked positions become logp's zeros (its dtype)."""
    if kl is not None and knobs.beta:
        per_token = per_token + knobs.beta * kl
    if knobs.entropy_coef:
        if entropy is None:
            raise ValueError("policy_loss: entropy_coef needs the tokens' entropy (entropy=...)")
        bonus = torch.where(keep, entropy, torch.zeros_like(logp))
        per_token = per_token - knobs.entropy_coef * bonus
    return per_token


def _loss_stats(
    ratio: Tensor, flags: dict[str, Tensor], kl: Tensor | None, keep: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Detached statistics over the counted tokens: the surrogate's flags' shares, the ratio's
    min, mean and max (1 with no counted token), and the mean KL when measured."""
    # no_grad as a block, not a decorator: mutmut skips decorated functions (make mutate)
    with torch.no_grad():
        counted = ratio[keep] if keep.any() else torch.ones(1, dtype=ratio.dtype)
        stats = {
            key: masked_mean((flag & keep).to(mask.dtype), mask) for key, flag in flags.items()
        }
        stats.update(
            {"ratio/min": counted.min(), "ratio/mean": counted.mean(), "ratio/max": counted.max()}
        )
        if kl is not None:
            stats["kl"] = masked_mean(kl, mask)
    return {k: v.detach() for k, v in stats.items()}


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    ref_logp: Tensor | None = None,
    knobs: LossKnobs = LossKnobs(),
    *,
    normalizer: Normalizer | None = None,
    importance_weights: Tensor | None = None,
    pg_mask: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss (a per-token surrogate) with an optional in-loss KL penalty and
    entropy bonus.

    logp, old_logp, ref_logp: [N, T] log-probs of the sampled tokens under the current, the
    sampling-time and the reference policy. advantages: [N] (one per completion, shared by its
    tokens) or [N, T] (one per token: REINFORCE++, GAE). loss_mask: [N, T] bool.
    knobs: the loss type, clip ranges, KL and entropy weights (``LossKnobs``).
    normalizer: step-wide counts; by default the batch given is the whole step and its length
    T is ``dr_grpo``'s budget (pass ``max_new_tokens`` when completions were cut shorter).
    importance_weights: [N, T] detached per-token weights (the sampler/trainer correction,
    ``importance_weights`` and ``offpolicy_sequence_mask``), multiplying the surrogate.
    pg_mask: [N, T] bool, tokens whose surrogate term counts (the high-entropy filter); the KL
    term and the aggregation's token counts still use ``loss_mask``, so filtered tokens count as
    zeros, as in the paper's objective.
    entropy: [N, T] the policy's entropy at each position, differentiable; with
    ``knobs.entropy_coef`` > 0 every counted token's term loses ``entropy_coef * entropy``.

    ``LOSS_TYPES[loss_type]`` names the surrogate and the aggregation. Per token, before
    ``+ beta*KL - entropy_coef*H``: ``clip`` ``-min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A)``;
    ``cispo`` ``-sg(clip(rho, 1-cispo_clip_low, 1+cispo_clip_high)) * A * logp``; ``sapo``
    ``-sigmoid(tau*(rho-1)) * 4/tau * A`` (tau = sapo_tau_pos if A > 0 else sapo_tau_neg).
    Returns the loss and detached statistics over counted tokens.
    """
    surrogate, aggregation = LOSS_TYPES[knobs.loss_type]
    if knobs.dual_clip is not None and surrogate != "clip":
        raise ValueError(
            f"dual_clip bounds the clipped surrogate; loss_type={knobs.loss_type!r} has none"
        )
    mask = loss_mask.to(logp.dtype)
    keep = loss_mask.bool()
    logp, old_logp = _zeroed(logp, keep), _zeroed(old_logp, keep)
    if normalizer is None:
        normalizer = Normalizer(
            num_sequences=logp.shape[0], num_tokens=float(mask.sum()), max_new_tokens=logp.shape[1]
        )
    ratio = torch.exp(LOG_RATIOS[knobs.ratio_level](logp, old_logp, mask))  # [N, T]
    adv = _token_advantages(advantages, keep)  # [N, 1] or [N, T]
    per_token, flags = SURROGATES[surrogate](ratio, logp, adv, knobs)  # [N, T]
    per_token = _policy_gradient_term(per_token, importance_weights, pg_mask)
    kl = None
    if ref_logp is not None:
        kl = KL_ESTIMATORS[knobs.kl_estimator](logp, _zeroed(ref_logp, keep))  # [N, T]
    per_token = _with_penalties(per_token, logp, kl, entropy, keep, knobs)
    loss = AGGREGATIONS[aggregation](per_token, mask, normalizer)
    return loss, _loss_stats(ratio, flags, kl, keep, mask)


# --------------------------------------------------------------------------------------- off-policy


def importance_weights(
    old_logp: Tensor,
    sampler_logp: Tensor,
    loss_mask: Tensor,
    *,
    cap: float | None,
    low: float | None = None,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights ``w = pi_old / pi_sampler`` for the sampler/trainer mismatch.

    old_logp: [N, T] the trainer's log-probs of the sampled tokens under the weights that
    sampled them; sampler_logp: [N, T] the sampling engine's own; loss_mask: [N, T] bool.
    level "token": one weight per token; "sequence": ``exp(mean_t(old - sampler))`` over the
    completion's counted tokens, shared by all of them.
    mode "truncate" (TIS, Yao et al. 2025): ``min(w, cap)``, only the upper side (a small
    weight never explodes the gradient); "mask" (MIS): ``w`` where ``low <= w <= cap``, else 0
    (the token or sequence leaves the policy-gradient term). ``cap`` or ``low`` None: no bound.
    A NaN weight is masked in either mode (and counted as masked).
    Returns detached [N, T] weights and the shares of counted tokens truncated and masked.
    """
    mask = loss_mask.to(old_logp.dtype)
    keep = loss_mask.bool()
    # masked positions may hold anything (even inf): zeroed, they reach no sequence mean
    old_logp = torch.where(keep, old_logp, torch.zeros_like(old_logp)).detach()
    sampler_logp = torch.where(keep, sampler_logp, torch.zeros_like(sampler_logp))
    weights = torch.exp(LOG_RATIOS[level](old_logp, sampler_logp, mask))  # [N, T]
    above = weights > cap if cap is not None else torch.zeros_like(keep)
    below = weights < low if low is not None else torch.zeros_like(keep)
    # a NaN weight (a NaN log-prob from either side) is masked in both modes: clamp and the
    # comparisons above would let it through into the loss
    broken = weights.isnan()
    if mode == "truncate":
        if low is not None:
            raise ValueError("importance_weights: a lower bound only masks (mode='mask')")
        truncated, masked = above, broken
        weights = weights.clamp(max=cap) if cap is not None else weights
    elif mode == "mask":
        truncated, masked = torch.zeros_like(keep), above | below | broken
    else:
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    weights = torch.where(masked, torch.zeros_like(weights), weights)
    stats = {
        "truncated_frac": masked_mean((truncated & keep).to(mask.dtype), mask),
        "masked_frac": masked_mean((masked & keep).to(mask.dtype), mask),
    }
    return weights, stats


def offpolicy_sequence_mask(
    logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, loss_mask: Tensor, delta: float
) -> Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2): which completions keep their surrogate.

    A completion with A < 0 is dropped when ``mean_t(behaviour_logp - logp) > delta`` over its
    counted tokens: the sampled-token estimate of KL(behaviour || current), so a negative
    sample the policy has already moved far from no longer pushes it. logp, behaviour_logp:
    [N, T]; advantages: [N], or [N, T] per token (a completion's sign is then that of their mean
    over its counted tokens); loss_mask: [N, T] bool. Returns [N] bool, True where kept.
    """
    mask = loss_mask.to(logp.dtype)
    counted = mask.sum(dim=1).clamp(min=1)  # [N]
    gap = torch.where(loss_mask.bool(), behaviour_logp - logp.detach(), torch.zeros_like(logp))
    divergence = (gap * mask).sum(dim=1) / counted  # [N]
    if advantages.dim() == 2:
        per_token = torch.where(loss_mask.bool(), advantages, torch.zeros_like(advantages))
        advantages = per_token.sum(dim=1) / counted  # [N]
    return ~((advantages < 0) & (divergence > delta))


def logprob_mismatch(
    trainer_logp: Tensor, sampler_logp: Tensor, loss_mask: Tensor
) -> dict[str, Tensor]:
    """Mean and max of |trainer - sampler| log-prob over counted tokens: [N, T] x2 -> scalars."""
    keep = loss_mask.bool()
    diff = (trainer_logp.detach() - sampler_logp)[keep].abs()  # [counted]
    if diff.numel() == 0:
        zero = torch.zeros((), dtype=trainer_logp.dtype)
        return {"mismatch_mean": zero, "mismatch_max": zero}
    return {"mismatch_mean": diff.mean(), "mismatch_max": diff.max()}


# --------------------------------------------------------------------------------------- entropy


def top_entropy_mask(entropy: Tensor, loss_mask: Tensor, quantile: float) -> Tensor:
    """The highest-entropy ``quantile`` share of counted tokens: [N, T] -> [N, T] bool.

    Keeps tokens with entropy >= the (1 - quantile) quantile of the counted tokens' entropies
    (linear interpolation, as ``torch.quantile``); quantile 1 keeps every counted token.
    """
    keep = loss_mask.bool()
    if quantile >= 1.0 or not keep.any():
        return keep
    values = entropy.detach()[keep].float()  # [counted]
    threshold = torch.quantile(values, 1.0 - quantile)
    # a 0-dim threshold takes the entropy's dtype in the comparison (torch's promotion rule)
    return keep & (entropy.detach() >= threshold)


def adapted_entropy_coef(coef: float, entropy: float, target: float, step: float) -> float:
    """The next step's entropy-bonus coefficient (Skywork-OR1, He et al., 2025): ``step``
    higher when the measured mean token entropy is below ``target``, ``step`` lower when above,
    never below 0. A step with no measurement (NaN: no counted token) leaves it as it is."""
    if math.isnan(entropy) or entropy == target:
        return coef
    return max(coef + step if entropy < target else coef - step, 0.0)


# --------------------------------------------------------------------------------------- reference


@torch.no_grad()
def soft_update_(targets: list[Tensor], sources: list[Tensor], alpha: float) -> None:
    """In place ``target <- alpha * source + (1 - alpha) * target``; alpha 1 is an exact copy.

    The reference refresh of iterative GRPO (DeepSeekMath) with TR-DPO's soft mixing.
    """
    for target, source in zip(targets, sources, strict=True):
        if alpha == 1.0 or not target.is_floating_point():
            target.copy_(source)  # integer buffers (positions, counters) are copied, never mixed
        else:
            target.mul_(1.0 - alpha).add_(source.to(target.dtype), alpha=alpha)
