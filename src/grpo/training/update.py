"""The policy update: ``num_iterations`` optimizer steps on one scored batch, each accumulating
gradients over length-sorted micro-batches (``micro_batches``), with the reference and old
log-probs scored first when the loss needs them and per-token advantages after them
(``advantages``; with ppo, from the critic's values, and the critic's own step after each of
the policy's, ``critic``). No formula here: the losses are ``grpo.algorithm``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from grpo import algorithm
from grpo.config import Config
from grpo.models import Reference
from grpo.runtime import distributed
from grpo.runtime.distributed import DistInfo
from grpo.runtime.precision import bf16_autocast
from grpo.scoring.logprobs import completion_logprobs
from grpo.step_data import Scored
from grpo.training import advantages, importance
from grpo.training.critic import Critic, value_metrics
from grpo.training.entropy_bonus import EntropyBonus
from grpo.training.micro_batches import MicroBatch, micro_batches, scatter_rows
from grpo.training.optimizer import clip_and_step, takes_step
from grpo.training.update_stats import UpdateStats


class PolicyUpdate:
    """The update stage of a step; the trainer holds the same policy, optimizer and schedule."""

    def __init__(
        self,
        config: Config,
        dist: DistInfo,
        policy: nn.Module,
        train_model: nn.Module,
        reference: Reference | None,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        entropy_bonus: EntropyBonus,
        critic: Critic | None = None,
    ) -> None:
        self.config, self.dist = config, dist
        self.policy, self.train_model, self.reference = policy, train_model, reference
        self.optimizer, self.scheduler, self.entropy_bonus = optimizer, scheduler, entropy_bonus
        self.critic = critic  # estimator ppo

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

    def __call__(self, scored: Scored, step: int) -> dict[str, float]:
        """``num_iterations`` optimizer steps on one scored batch; returns the update's metrics."""
        cfg = self.config.algorithm
        rollout = scored.rollout
        optim = self.config.optim
        size, budget = optim.micro_batch_size, optim.micro_batch_tokens
        batches = micro_batches(rollout, scored.advantages, size, budget)
        most = int(distributed.all_reduce(len(batches), "max"))
        if most != len(batches):
            # DDP/FSDP reduce once per backward: every rank runs the same number of them (token
            # budgets cut each rank's rows differently)
            batches = micro_batches(rollout, scored.advantages, size, budget, count=most)
        batches = [mb.to(self.dist.device) for mb in batches]
        ref_all, old_all = self.frozen_logprobs(batches, tuple(rollout.completion_ids.shape))
        # mask_truncated_completions: a cut-off completion contributes no token to the loss
        counted = advantages.counted_mask(rollout, cfg)
        counted_here = counted.to(self.dist.device)
        normalizer = algorithm.Normalizer(
            num_sequences=rollout.num_completions,
            num_tokens=distributed.local_share_of_global(float(counted.sum())),
            num_micro_batches=len(batches),
            max_new_tokens=self.config.rollout.max_new_tokens,
        )
        value_out: dict[str, float] = {}
        if self.critic is not None:
            old_values = self.critic.values(batches, tuple(rollout.completion_ids.shape))
            per_token, returns = advantages.critic_advantages(
                cfg, scored.rewards, counted, old_all, ref_all, old_values
            )
            value_out = value_metrics(old_values, returns, counted_here)
        else:
            per_token = advantages.token_advantages(cfg, scored.rewards, counted, old_all, ref_all)
        if per_token is not None:
            batches = advantages.with_token_advantages(batches, per_token)
        sampler_all = rollout.sampler_logp
        if sampler_all is not None:
            sampler_all = sampler_all.to(self.dist.device)
        pg_masks: dict[int, Tensor] = {}  # micro-batch -> high-entropy tokens, fixed at iteration 0
        stats = UpdateStats()
        skipped = 0  # optimizer steps not taken: a zero or non-finite gradient
        coef = self.entropy_bonus.coef
        for iteration in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for k, mb in enumerate(batches):
                # gradients cross ranks once per optimizer step, with the last micro-batch
                with distributed.gradient_sync(self.train_model, enabled=k == len(batches) - 1):
                    t = mb.completion_ids.shape[1]
                    logp, entropy = self.logprobs(
                        self.train_model, mb, entropy=iteration == 0 or coef > 0
                    )
                    old = logp.detach() if old_all is None else old_all[mb.index, :t]
                    ref = None if ref_all is None else ref_all[mb.index, :t]
                    sampler = None if sampler_all is None else sampler_all[mb.index, :t]
                    loss_mask = counted_here[mb.index, :t]
                    weights, shares = importance.correction(
                        cfg, logp, old, sampler, mb.advantages, loss_mask
                    )
                    if iteration == 0 and cfg.top_entropy_quantile < 1:
                        pg_masks[k] = algorithm.top_entropy_mask(
                            entropy, loss_mask, cfg.top_entropy_quantile
                        )
                    loss, loss_stats = algorithm.policy_loss(
                        logp,
                        old,
                        mb.advantages,
                        loss_mask,
                        ref,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        beta=advantages.loss_beta(cfg),
                        loss_type=cfg.loss_type,
                        ratio_level=cfg.ratio_level,
                        kl_estimator=cfg.kl_estimator,
                        dual_clip=cfg.dual_clip,
                        cispo_clip_low=cfg.cispo_clip_low,
                        cispo_clip_high=cfg.cispo_clip_high,
                        sapo_tau_pos=cfg.sapo_tau_pos,
                        sapo_tau_neg=cfg.sapo_tau_neg,
                        normalizer=normalizer,
                        importance_weights=weights,
                        pg_mask=pg_masks.get(k),
                        entropy=entropy,
                        entropy_coef=coef,
                    )
                    loss.backward()
                    loss_total += float(loss.detach())
                stats.add_pass(loss_stats, loss_mask)
                stats.add_shares(shares)
                if iteration == 0:
                    stats.add_rollout(entropy, loss_mask, pg_masks.get(k), old, sampler)
            grad_norm = clip_and_step(
                self.policy,
                self.optimizer,
                self.scheduler,
                self.config.optim.max_grad_norm,
                step,
                self.dist.is_main,
            )
            skipped += not takes_step(grad_norm)
            if self.critic is not None:  # the critic's own step on the same micro-batches
                critic_stats = self.critic.update(
                    batches, returns, old_values, counted_here, step, self.dist.is_main
                )
                if iteration == 0:
                    value_out.update(critic_stats)
            if iteration == 0:
                first_loss, first_norm = loss_total, grad_norm
        out = stats.reduce()
        # the loss is the sum of the ranks' shares of the step's mean loss
        out["loss"] = distributed.all_reduce(first_loss) / self.dist.world_size
        out["grad_norm"] = first_norm
        out["optim/skipped"] = skipped / cfg.num_iterations
        out.update(self.entropy_bonus.observe(out))
        out.update(value_out)
        return out
