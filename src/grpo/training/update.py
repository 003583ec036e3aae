"""The policy update: ``num_iterations`` optimizer steps on one scored batch, in three phases.

- prepare (``PolicyUpdate.prepare`` -> ``Prepared``): the length-sorted micro-batches
  (``micro_batches``), the reference and old log-probs when the loss needs them, the per-token
  advantages after them (``advantages``; with ppo, from the critic's values), the step's
  normaliser and the sampler's log-probs;
- the loss of one micro-batch (``PolicyUpdate.micro_batch_loss`` -> ``MicroBatchLoss``), its
  gradient accumulated over the micro-batches of a pass;
- the optimizer step (``PolicyUpdate.optimizer_step``), then the critic's own (``critic``).

It returns an ``UpdateResult``. No formula here: the losses are ``grpo.algorithm``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo import algorithm
from grpo.config import AlgorithmConfig, Config
from grpo.runtime import distributed
from grpo.runtime.distributed import DistInfo
from grpo.runtime.precision import bf16_autocast
from grpo.scoring.logprobs import completion_logprobs
from grpo.step_data import Scored
from grpo.training import advantages, importance
from grpo.training.critic import value_metrics
from grpo.training.micro_batches import MicroBatch, micro_batches, scatter_rows
from grpo.training.optimizer import clip_and_step, takes_step
from grpo.training.state import TrainingState
from grpo.training.update_stats import UpdateStats


def loss_knobs(algo: AlgorithmConfig, entropy_coef: float) -> algorithm.LossKnobs:
    """The loss's knobs from the config, with the entropy bonus's coefficient of this step."""
    return algorithm.LossKnobs(
        loss_type=algo.loss_type,
        ratio_level=algo.ratio_level,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
        cispo_clip_low=algo.cispo_clip_low,
        cispo_clip_high=algo.cispo_clip_high,
        sapo_tau_pos=algo.sapo_tau_pos,
        sapo_tau_neg=algo.sapo_tau_neg,
        beta=advantages.loss_beta(algo),
        kl_estimator=algo.kl_estimator,
        entropy_coef=entropy_coef,
    )


@dataclass(frozen=True)
class ValueTargets:
    """ppo's critic inputs of one step: old_values [N, T] its values before the update, returns
    [N, T] GAE's targets, and metrics (``value/mean``, ``value/explained_var``) of the two."""

    old_values: Tensor
    returns: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class Prepared:
    """What every pass of one update reads, computed once before the first. N completions, T
    completion tokens; each micro-batch holds b of the rows, trimmed to T' <= T tokens.

    batches: the micro-batches on the device, longest first; their advantages are [b], or
    [b, T'] where the estimator gives one per token.
    ref_logp, old_logp: [N, T] the reference's (beta > 0) and the proximal policy's (the
    weights at the start of the step; mu > 1, or a KL folded into the rewards) log-probs, or
    None.
    sampler_logp: [N, T] the sampling engine's own log-probs on the device, or None.
    counted: [N, T] bool on the device, the tokens the loss counts.
    normalizer: the step's counts, so that the micro-batch losses sum to the step's loss.
    knobs: the loss's knobs, with this step's entropy coefficient.
    values: the critic's inputs (ppo), else None.
    """

    batches: list[MicroBatch]
    ref_logp: Tensor | None
    old_logp: Tensor | None
    sampler_logp: Tensor | None
    counted: Tensor
    normalizer: algorithm.Normalizer
    knobs: algorithm.LossKnobs
    values: ValueTargets | None


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's forward under the current policy. Shapes [b, T'].

    loss: the micro-batch's share of the step's loss (with grad); stats: ``policy_loss``'s
    detached statistics; shares: what the sampler/trainer corrections touched.
    loss_mask: the counted tokens; entropy: the policy's entropy (None when not asked);
    old_logp: the ratio's denominator; sampler_logp: the sampler's, or None;
    pg_mask: the high-entropy tokens whose surrogate counts, or None (the filter off).
    """

    loss: Tensor
    stats: dict[str, Tensor]
    shares: importance.Shares
    loss_mask: Tensor
    entropy: Tensor | None
    old_logp: Tensor
    sampler_logp: Tensor | None
    pg_mask: Tensor | None


@dataclass(frozen=True)
class UpdateResult:
    """What one update returns: its metrics (loss, grad_norm, optim/skipped, the loss's and
    the rollout's statistics, the entropy bonus's and the critic's)."""

    metrics: dict[str, float]


def _rows(values: Tensor | None, mb: MicroBatch) -> Tensor | None:
    """The micro-batch's rows of a step-wide [N, T] tensor, trimmed to its T'; None stays None."""
    return None if values is None else values[mb.index, : mb.completion_ids.shape[1]]


class PolicyUpdate:
    """The update stage of a step; the trainer holds the same policy, optimizer and schedule."""

    def __init__(
        self, config: Config, dist: DistInfo, state: TrainingState, train_model: nn.Module
    ) -> None:
        self.config, self.dist, self.train_model = config, dist, train_model
        # the state's parts the update moves (their one owner is ``state``)
        self.policy, self.reference = state.policy, state.reference
        self.optimizer, self.scheduler = state.optimizer, state.scheduler
        self.entropy_bonus, self.critic = state.entropy_bonus, state.critic

    def logprobs(self, model: nn.Module, mb: MicroBatch, entropy: bool = False):
        with bf16_autocast(self.dist.device, self.config.model.autocast, cache=False):
            return completion_logprobs(
                model,
                mb.prompt_ids,
                mb.prompt_mask,
                mb.completion_ids,
                mb.completion_mask,
                mb.decoding,
                with_entropy=entropy,
            )

    def frozen_logprobs(self, batches: list[MicroBatch], shape: tuple[int, int]):
        """Reference log-probs (beta > 0) and old log-probs (mu > 1): [N, T] each, or None."""
        ref = old = None
        # no_grad as a block, not a decorator: mutmut skips decorated functions (make mutate)
        with torch.no_grad():
            if self.reference is not None:
                ref = torch.zeros(shape, device=self.dist.device)
                with self.reference.model() as model:
                    for mb in batches:
                        scatter_rows(ref, mb, self.logprobs(model, mb)[0])
            if advantages.needs_old_logprobs(self.config.algorithm):
                old = torch.zeros(shape, device=self.dist.device)
                for mb in batches:
                    scatter_rows(old, mb, self.logprobs(self.policy, mb)[0])
        return ref, old

    def prepare(self, scored: Scored) -> Prepared:
        """The micro-batches and everything every pass reads, in one place."""
        cfg = self.config.algorithm
        rollout = scored.rollout
        size, budget = self.config.optim.micro_batch_size, self.config.optim.micro_batch_tokens
        batches = micro_batches(rollout, scored.advantages, size, budget)
        most = int(distributed.all_reduce(len(batches), "max"))
        if most != len(batches):
            # DDP/FSDP reduce once per backward: every rank runs the same number of them (token
            # budgets cut each rank's rows differently)
            batches = micro_batches(rollout, scored.advantages, size, budget, count=most)
        batches = [mb.to(self.dist.device) for mb in batches]
        shape = tuple(rollout.completion_ids.shape)
        ref_all, old_all = self.frozen_logprobs(batches, shape)
        # mask_truncated_completions: a cut-off completion contributes no token to the loss
        counted = advantages.counted_mask(rollout, cfg)
        counted_here = counted.to(self.dist.device)
        normalizer = algorithm.Normalizer(
            num_sequences=rollout.num_completions,
            num_tokens=distributed.local_share_of_global(float(counted.sum())),
            num_micro_batches=len(batches),
            max_new_tokens=self.config.rollout.max_new_tokens,
        )
        values = None
        if self.critic is not None:
            old_values = self.critic.values(batches, shape)
            per_token, returns = advantages.critic_advantages(
                cfg, scored.rewards, counted, old_all, ref_all, old_values
            )
            metrics = value_metrics(old_values, returns, counted_here)
            values = ValueTargets(old_values, returns, metrics)
        else:
            per_token = advantages.token_advantages(cfg, scored.rewards, counted, old_all, ref_all)
        if per_token is not None:
            batches = advantages.with_token_advantages(batches, per_token)
        sampler = rollout.sampler_logp
        return Prepared(
            batches=batches,
            ref_logp=ref_all,
            old_logp=old_all,
            sampler_logp=None if sampler is None else sampler.to(self.dist.device),
            counted=counted_here,
            normalizer=normalizer,
            knobs=loss_knobs(cfg, self.entropy_bonus.coef),
            values=values,
        )

    def micro_batch_loss(
        self,
        prep: Prepared,
        mb: MicroBatch,
        iteration: int,
        pg_mask: Tensor | None,
    ) -> MicroBatchLoss:
        """The forward and the loss of one micro-batch. pg_mask: [b, T'] its high-entropy tokens,
        fixed at iteration 0 (None: computed here when the filter is on, else none)."""
        cfg = self.config.algorithm
        logp, entropy = self.logprobs(
            self.train_model, mb, entropy=iteration == 0 or prep.knobs.entropy_coef > 0
        )
        old = logp.detach() if prep.old_logp is None else _rows(prep.old_logp, mb)
        sampler = _rows(prep.sampler_logp, mb)
        loss_mask = _rows(prep.counted, mb)
        weights, shares = importance.correction(cfg, logp, old, sampler, mb.advantages, loss_mask)
        if iteration == 0 and cfg.top_entropy_quantile < 1:
            pg_mask = algorithm.top_entropy_mask(entropy, loss_mask, cfg.top_entropy_quantile)
        loss, stats = algorithm.policy_loss(
            logp,
            old,
            mb.advantages,
            loss_mask,
            _rows(prep.ref_logp, mb),
            knobs=prep.knobs,
            normalizer=prep.normalizer,
            importance_weights=weights,
            pg_mask=pg_mask,
            entropy=entropy,
        )
        return MicroBatchLoss(loss, stats, shares, loss_mask, entropy, old, sampler, pg_mask)

    def accumulate(
        self, prep: Prepared, iteration: int, pg_masks: list[Tensor | None], stats: UpdateStats
    ) -> float:
        """One pass: each micro-batch's loss and backward, gradients summed; returns the sum of
        the losses. pg_masks: each micro-batch's high-entropy tokens, filled at iteration 0."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        last = len(prep.batches) - 1
        for k, mb in enumerate(prep.batches):
            # gradients cross ranks once per optimizer step, with the last micro-batch
            with distributed.gradient_sync(self.train_model, enabled=k == last):
                part = self.micro_batch_loss(prep, mb, iteration, pg_masks[k])
                part.loss.backward()
                loss_total += float(part.loss.detach())
            pg_masks[k] = part.pg_mask
            stats.add_pass(part.stats, part.loss_mask)
            stats.add_shares(part.shares)
            if iteration == 0:
                stats.add_rollout(
                    part.entropy, part.loss_mask, part.pg_mask, part.old_logp, part.sampler_logp
                )
        return loss_total

    def optimizer_step(self, prep: Prepared, step: int) -> tuple[float, dict[str, float]]:
        """The policy's optimizer step on the accumulated gradient, then the critic's own on
        the same micro-batches; returns the policy's gradient norm and the critic's metrics."""
        grad_norm = clip_and_step(
            self.policy,
            self.optimizer,
            self.scheduler,
            self.config.optim.max_grad_norm,
            step,
            self.dist.is_main,
        )
        if self.critic is None:
            return grad_norm, {}
        values = prep.values
        critic_stats = self.critic.update(
            prep.batches, values.returns, values.old_values, prep.counted, step, self.dist.is_main
        )
        return grad_norm, critic_stats

    def __call__(self, scored: Scored, step: int) -> UpdateResult:
        """``num_iterations`` optimizer steps on one scored batch."""
        num_iterations = self.config.algorithm.num_iterations
        prep = self.prepare(scored)
        pg_masks: list[Tensor | None] = [None] * len(prep.batches)
        stats = UpdateStats()
        skipped = 0  # optimizer steps not taken: a zero or non-finite gradient
        for iteration in range(num_iterations):
            loss_total = self.accumulate(prep, iteration, pg_masks, stats)
            grad_norm, critic_stats = self.optimizer_step(prep, step)
            skipped += not takes_step(grad_norm)
            if iteration == 0:
                first_loss, first_norm, first_critic = loss_total, grad_norm, critic_stats
        out = stats.reduce()
        # the loss is the sum of the ranks' shares of the step's mean loss
        out["loss"] = distributed.all_reduce(first_loss) / self.dist.world_size
        out["grad_norm"] = first_norm
        out["optim/skipped"] = skipped / num_iterations
        out.update(self.entropy_bonus.observe(out))
        if prep.values is not None:
            out.update(prep.values.metrics)
        out.update(first_critic)
        return UpdateResult(metrics=out)
