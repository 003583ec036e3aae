"""A step's advantages: the configured estimator and reward aggregation (``grpo.algorithm``)
applied to the step's rewards, with statistics over every rank's completions.

- Per completion (``batch_advantages``), after scoring: grpo and rloo within each group, of the
  weighted total (``reward_aggregation: sum``) or of each function before the weighted sum, then
  over the batch (``gdpo``). reinforce_pp's are its advantages without the KL term: the rewards
  normalised over the counted tokens (what every token gets when beta is 0).
- Per token (``token_advantages``), once the reference log-probs exist: reinforce_pp with
  beta > 0 folds the KL of the proximal policy to the reference into the token rewards, and
  the loss then carries no KL term (``loss_beta``). The proximal policy is the weights at the
  start of the step: the sampler's at ``rollout.max_staleness`` 0, but not at k >= 1, where
  the rollouts come from older weights (docs/ahead.md, the decoupled objective).
- ppo (``critic_advantages``), once the critic has scored the step: GAE over the same token
  rewards (KL folded in as reinforce_pp's), whitened over the batch's counted tokens, and the
  critic's targets. Its per-completion ones (for metrics and dynamic sampling's choice) are
  reinforce_pp's, the rewards normalised over the batch.

Under torchrun each rank holds whole groups, so group statistics are local; batch statistics
(batch scale, GDPO's and REINFORCE++'s normalisation) are over the rows of every rank, which are
gathered, normalised as one batch, and sliced back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from grpo import algorithm
from grpo.config import AlgorithmConfig
from grpo.runtime import distributed
from grpo.step_data import Rollout
from grpo.training.micro_batches import MicroBatch


def counted_mask(rollout: Rollout, algo: AlgorithmConfig) -> Tensor:
    """[N, T] the tokens the loss counts: the policy's own, without truncated completions
    when ``mask_truncated_completions``."""
    if not algo.mask_truncated_completions:
        return rollout.loss_mask
    return rollout.loss_mask & ~rollout.truncated[:, None]


def _as_they_are(rows: Tensor) -> Tensor:
    return rows


# estimators whose KL goes into the token rewards (the loss has none) and whose advantages are
# per token, normalised over the batch rather than within groups
KL_IN_REWARDS = ("reinforce_pp", "ppo")


def batch_advantages(
    algo: AlgorithmConfig,
    group_size: int,
    rewards: Tensor,
    per_function: Tensor,
    weights: Tensor,
    counted: Tensor,
    gather: Callable[[Tensor], Tensor] = _as_they_are,
) -> Tensor:
    """[N] advantages of a batch of whole groups: rewards [N] (the weighted total),
    per_function [N, K] (NaN for None), weights [K], counted [N] tokens each completion has
    in the loss. ``gather`` makes the batch of the rows given (every rank's, under torchrun);
    only the inputs the estimator reads are gathered."""
    if algo.estimator in KL_IN_REWARDS:
        return algorithm.batch_normalize(gather(rewards), gather(counted), algo.adv_eps)
    if algo.reward_aggregation == "gdpo":
        return algorithm.decoupled_advantages(
            gather(per_function),
            weights,
            group_size,
            algo.estimator,
            algo.scale_rewards,
            algo.adv_eps,
        )
    return algorithm.ESTIMATORS[algo.estimator](
        gather(rewards), group_size, algo.scale_rewards, algo.adv_eps
    )


def rank_advantages(
    algo: AlgorithmConfig,
    rollout: Rollout,
    rewards: Tensor,
    per_function: Tensor,
    weights: Tensor,
) -> Tensor:
    """This rank's [N] advantages, with batch statistics over every rank's completions."""
    counted = counted_mask(rollout, algo).sum(dim=1)  # [N]
    everyone = batch_advantages(
        algo,
        rollout.group_size,
        rewards,
        per_function,
        weights,
        counted,
        distributed.all_gather_rows,
    )
    return everyone[distributed.rank_slice(len(rewards))]


def loss_beta(algo: AlgorithmConfig) -> float:
    """The KL weight in the loss: none where the estimator put the KL into the rewards."""
    return 0.0 if algo.estimator in KL_IN_REWARDS else algo.beta


def needs_old_logprobs(algo: AlgorithmConfig) -> bool:
    """Whether the step needs the proximal policy's log-probs (the weights at the start of the
    step) before its first update: for mu > 1, and for a KL folded into the rewards (its KL)."""
    return algo.num_iterations > 1 or (algo.estimator in KL_IN_REWARDS and algo.beta > 0)


def token_advantages(
    algo: AlgorithmConfig,
    rewards: Tensor,
    counted: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
) -> Tensor | None:
    """This rank's [N, T] per-token advantages, or None where the [N] ones hold for every token.

    rewards: [N]; counted: [N, T] the loss's tokens; old_logp, ref_logp: [N, T] (the proximal
    policy's, the weights at the start of the step, and the reference's). Only reinforce_pp with beta > 0 is per token.
    """
    if algo.estimator != "reinforce_pp" or ref_logp is None or old_logp is None:
        return None
    device = ref_logp.device
    counted = counted.to(device)
    kl = algorithm.KL_ESTIMATORS[algo.kl_estimator](old_logp, ref_logp)  # [N, T]
    gather = distributed.all_gather_rows
    everyone = algorithm.reinforce_pp_advantages(
        gather(rewards.to(device)), gather(counted), gather(kl), algo.beta, algo.adv_eps
    )
    return everyone[distributed.rank_slice(len(rewards)), : counted.shape[1]]


def critic_advantages(
    algo: AlgorithmConfig,
    rewards: Tensor,
    counted: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    values: Tensor,
) -> tuple[Tensor, Tensor]:
    """ppo: ([N, T] advantages whitened over the batch's counted tokens, [N, T] the critic's
    targets). rewards: [N]; counted: [N, T]; values: [N, T] the critic's before the update;
    old_logp, ref_logp: [N, T] when beta > 0 (the KL of the proximal policy, the weights at the
    start of the step, in the rewards)."""
    device = values.device
    counted = counted.to(device)
    shaped = None
    if algo.beta > 0 and old_logp is not None and ref_logp is not None:
        shaped = -algo.beta * algorithm.KL_ESTIMATORS[algo.kl_estimator](old_logp, ref_logp)
    token_rewards = algorithm.per_token_rewards(rewards.to(device), counted, shaped)
    raw, returns = algorithm.gae(token_rewards, values, counted, algo.gamma, algo.lam)
    whitened = algorithm.batch_normalize(raw, counted, algo.adv_eps)
    whitened = torch.where(counted.bool(), whitened, torch.zeros_like(whitened))
    return whitened.to(values.dtype), returns.to(values.dtype)


def with_token_advantages(batches: list[MicroBatch], advantages: Tensor) -> list[MicroBatch]:
    """The micro-batches with their rows' per-token advantages ([N, T] -> [b, T'] each)."""
    return [
        dataclasses.replace(mb, advantages=advantages[mb.index, : mb.completion_ids.shape[1]])
        for mb in batches
    ]
