"""The training loop: wires rollout, rewards, advantages, log-probs and the loss. No formula here.

One step: P prompts -> G completions each -> rewards -> advantages (``advantages``) ->
(reference and old log-probs, only when needed; per-token advantages) -> ``num_iterations``
optimizer steps, each accumulating gradients over length-sorted micro-batches -> metrics,
sampled completions, checkpoint.

The parts come from ``grpo.build``; checkpoints (``checkpoint``), the resume decision
(``resume``), micro-batches, update statistics, the optimizer, signals and console noise each
live in their own module of this package.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo import build
from grpo.config import Config, ConfigError, dump_config, load_config
from grpo.eval import evaluate, settings_for
from grpo.models import resolve_model_path
from grpo.rewards import ErrorWatch
from grpo.rollout import RolloutEngine, RolloutLost
from grpo.runs.directory import RunDir, RunDirError, is_disk_full
from grpo.runs.metrics import MetricsLogger, ProgressBar
from grpo.runtime import distributed
from grpo.runtime.host_memory import set_malloc_policy
from grpo.runtime.precision import bf16_autocast
from grpo.scoring.chunked_head import chunked_head_slot, full_logits
from grpo.scoring.logprobs import scoring_path
from grpo.step_data import Scored
from grpo.training.ahead import ProducerProcess
from grpo.training.checkpoint import load_checkpoint, save_checkpoint, save_final
from grpo.training.console import TransformersBars, warn_about
from grpo.training.critic import Critic
from grpo.training.entropy_bonus import EntropyBonus
from grpo.training.gather import gather_scored
from grpo.training.given import Given, RewardItem, given_parts
from grpo.training.hack_watch import HackWatch
from grpo.training.optimizer import build_optimizer
from grpo.training.producer import Producer
from grpo.training.prompt_selection import rank_groups
from grpo.training.resume import ResumePlan, fingerprints, open_run, plan_resume
from grpo.training.signals import StopSignals, TrainingStopped
from grpo.training.step_metrics import completion_records, sampling_metrics, step_metrics
from grpo.training.update import PolicyUpdate


class Trainer:
    """Builds everything from a Config (validating before writing anything), then trains."""

    def __init__(
        self, config: Config, engine: RolloutEngine | None = None, given: Given | None = None
    ) -> None:
        set_malloc_policy(config.train.malloc)  # see grpo/runtime/host_memory.py
        build.prepare_process(config)
        self.config = config
        self.dist = distributed.init_from_env()
        if config.rollout.prompts_per_step % self.dist.world_size:
            raise ConfigError(
                f"rollout.prompts_per_step={config.rollout.prompts_per_step} must be divisible "
                f"by the number of processes ({self.dist.world_size}): each rank takes whole groups"
            )
        if self.dist.is_main:
            warn_about(config)
        torch.manual_seed(config.train.seed)
        random.seed(config.train.seed)
        # everything that can fail on bad input happens before the run directory is touched
        self.given = given or Given()
        self.rows, self.eval_rows = build.training_rows(config, self.given)
        self.prompt_format = build.prompt_format(config)
        self.hack_watch = HackWatch(config.train.hack_watch, config.rewards.functions)
        self.rewards = build.reward_runner(config, self.rows, self.given.rewards)
        self.verifier = build.verifier_runner(config) if config.train.eval_every else None
        self.reward_errors = ErrorWatch(
            config.rewards.max_error_frac, config.rewards.error_patience
        )
        model_path = None if self.given.model else resolve_model_path(config.model.name)
        # what checkpoints fingerprint, so a resume sees inputs changed under the same names
        self.inputs = fingerprints(config, self.rows, model_path, self.given)
        # the run directory is locked, and a resume checked, before the model loads
        self.run = RunDir(config.run_dir)
        self.bars = TransformersBars(config.train.progress)  # until train() ends
        try:
            # auto precision decided once, by rank 0, before the run directory saves or compares it
            shape_of = model_path or self.given.model.config
            self.config = distributed.from_main(
                lambda: build.concrete_precision(config, shape_of, self.dist.device)
            )
            self.plan: ResumePlan = distributed.from_main(self._claim_run_dir)
            self._build(model_path, engine)
        except BaseException:  # what was started is stopped: reward workers, the lock, the bars
            self._close_rewards()
            self.run.release()
            self.bars.restore()
            raise

    def _claim_run_dir(self) -> ResumePlan:
        """Rank 0: lock the run directory and decide where the run starts."""
        self.run.claim()
        return plan_resume(self.run, self.config, self.dist.world_size, self.inputs)

    def _build(self, model_path: str | None, engine: RolloutEngine | None) -> None:
        config, given, device = self.config, self.given, self.dist.device
        fmt, rows = self.prompt_format, self.rows
        self.tokenizer, self.policy = (
            build.given_model(config.model, given.model, given.tokenizer, fmt, rows, device)
            if given.model is not None
            else build.load_model(config.model, model_path, fmt, rows, device)
        )
        self.policy.train()
        self.reference = build.reference_of(config, self.policy)
        # training forwards go through the DDP wrapper / the FSDP2-sharded policy; generation and
        # saving use self.policy (the same module, and the same object under FSDP2)
        self.train_model = distributed.wrap_model(self.policy, config.train.distributed, self.dist)
        frozen_copy = self.reference.copy if self.reference is not None else None
        if not config.model.chunked_head:
            for model in (self.policy, frozen_copy):
                if model is not None:
                    full_logits(model)
        if self.dist.is_main:
            path, why = scoring_path(self.policy)
            head = "a chunk at a time" if chunked_head_slot(self.policy) else "full logits"
            print(f"scoring log-probs: {path} ({why}); LM head: {head}")
        fsdp = self.dist.enabled and config.train.distributed == "fsdp"
        if fsdp and frozen_copy is not None:
            distributed.fully_shard_model(frozen_copy, self.dist)
        self.producer = self._producer(model_path, engine)
        self.optimizer, self.scheduler = build_optimizer(
            self.policy,
            config.optim,
            config.train.steps * config.algorithm.num_iterations,
            fused=not fsdp,
        )
        self.entropy_bonus = EntropyBonus(config.algorithm)
        self.critic = self._critic()
        self.update = PolicyUpdate(
            config,
            self.dist,
            self.policy,
            self.train_model,
            self.reference,
            self.optimizer,
            self.scheduler,
            self.entropy_bonus,
            self.critic,
        )
        self.step = 0
        self.saved_step = -1  # the step of the newest checkpoint on disk
        self.lost: RolloutLost | None = None  # generation elsewhere failed after an update

    def _critic(self) -> Critic | None:
        """PPO's value model (``estimator: ppo``), on this process's device."""
        if self.config.algorithm.estimator != "ppo":
            return None
        if self.dist.enabled:
            raise ConfigError(
                "algorithm.estimator=ppo trains its critic in one process: not under torchrun "
                "(use grpo, rloo or reinforce_pp there)"
            )
        return Critic(self.config, self.policy, self.dist.device)

    def _producer(
        self, model_path: str | None, engine: RolloutEngine | None
    ) -> Producer | ProducerProcess:
        """The producer of the steps' groups: in this process, or (``rollout.max_staleness``
        >= 1) ahead of it in another (``grpo.training.ahead``). ``self.engine`` is the one
        held-out evaluation samples with (with a producer process: built only for it)."""
        config = self.config
        if not config.rollout.max_staleness:
            self.engine = build.engine_of(config, self.policy, self.tokenizer, engine)
            return Producer(
                config,
                self.dist,
                self.rows,
                self.prompt_format,
                self.tokenizer,
                self.policy,
                self.engine,
                self.rewards,
            )
        if self.dist.enabled or engine is not None:
            why = "under torchrun" if self.dist.enabled else "with an engine object given"
            raise ConfigError(
                f"rollout.max_staleness={config.rollout.max_staleness} runs the producer in a "
                f"process of its own, not {why}: use max_staleness 0"
            )
        # held-out evaluation samples this process's own weights, which the producer's engine
        # (a vLLM or a rollout server, weights pushed by the producer) does not hold: the HF
        # engine over the policy itself
        hf = config.rollout.model_copy(update={"engine": "hf"})
        here = config.model_copy(update={"rollout": hf})
        self.engine = (
            build.engine_of(here, self.policy, self.tokenizer) if config.train.eval_every else None
        )
        return ProducerProcess(
            config,
            self.rows,
            self.given.rewards,
            model_path,
            self.policy,
            self.tokenizer,
            self.dist.device,
        )

    # ----------------------------------------------------------------------------- update

    def optimize(self, scored: Scored) -> dict[str, float]:
        """The update on one scored batch (``grpo.training.update``)."""
        return self.update(scored, self.step)

    # ----------------------------------------------------------------------------- loop

    def train(self) -> Path:
        main = self.dist.is_main  # only rank 0 touches the run directory
        try:
            if self.plan.checkpoint is not None:
                load_checkpoint(self, self.plan.checkpoint.path)
            if main:
                open_run(self.run, self.plan, dump_config(self.config))
            with StopSignals(announce=main) as stop:
                self._loop(stop)
        except KeyboardInterrupt:  # a second Ctrl-C
            raise TrainingStopped(signal.SIGINT, self.step, self.run.intact, True) from None
        except Exception as err:
            if is_disk_full(err) or self.run.nearly_full():
                raise RunDirError(self.run.disk_full_message(err)) from None
            raise
        finally:
            self.producer.close()
            self._close_rewards()
            self.run.release()
            self.bars.restore()
        return self.config.run_dir

    def _loop(self, stop: StopSignals) -> None:
        cfg = self.config.train
        main = self.dist.is_main
        logger = MetricsLogger(self.config.run_dir, cfg.sinks, self.step) if main else None
        bar = ProgressBar(cfg.steps, self.step, cfg.progress and main)
        try:
            if cfg.eval_every and self.step == 0:
                baseline = self.held_out_eval()  # the baseline every later eval compares to
                if logger:
                    logger.log(0, baseline)
            while self.step < cfg.steps:
                # every rank stops after the same step, whichever got the signal
                signum = int(distributed.all_reduce(stop.signum, "max"))
                if signum:
                    if self.step > 0 and self.saved_step != self.step:
                        save_checkpoint(self)
                    raise TrainingStopped(signum, self.step, self.run.intact, False)
                self.step += 1
                try:
                    metrics = self.train_step()
                except RolloutLost as lost:  # before the update: the steps done are kept
                    self.step -= 1
                    self._stop_lost(lost, f"before step {self.step + 1}")
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                    metrics.update(self.held_out_eval())
                if logger:
                    logger.log(self.step, metrics)
                bar.update(self.step, metrics)
                if cfg.save_every and self.step % cfg.save_every == 0:
                    save_checkpoint(self)
                if self.lost is not None:  # after the update: the step is logged and kept
                    self._stop_lost(self.lost, f"after step {self.step}")
            if self.saved_step != self.step:
                save_checkpoint(self)
            if distributed.from_main(self.run.final_step) != self.step:
                save_final(self)
        finally:
            bar.close()
            if logger:
                logger.close()

    def _stop_lost(self, lost: RolloutLost, when: str) -> None:
        """Stop for generation that failed elsewhere: a checkpoint of the steps done, one line."""
        if self.step > 0 and self.saved_step != self.step:
            save_checkpoint(self)
        saved = f"{self.run.intact} is complete" if self.run.intact else "no checkpoint"
        raise type(lost)(f"{lost} {when}: {saved}") from None

    def held_out_eval(self) -> dict[str, float]:
        """``eval/*`` metrics of the current policy on the held-out rows (see grpo.eval)."""
        t0 = time.perf_counter()
        settings = settings_for(self.config, self.config.train.eval_samples)
        # every rank evaluates the same rows (FSDP2: on gathered weights, as for rollouts)
        with (
            distributed.full_parameters(self.policy),
            bf16_autocast(self.dist.device, self.config.model.autocast),
        ):
            result = evaluate(
                self.engine,
                self.tokenizer,
                self.eval_rows,
                self.prompt_format,
                self.verifier,
                settings,
                self.rewards,
            )
        out = {f"eval/{key}": value for key, value in result.items()}
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def _close_rewards(self) -> None:
        self.rewards.close()
        if self.verifier is not None:
            self.verifier.close()

    def refresh_reference(self) -> dict[str, float]:
        """Every ``ref_update_every`` steps the reference takes the policy's weights."""
        every = self.config.algorithm.ref_update_every
        if not every or self.reference is None:
            return {}
        if self.step % every == 0:
            self.reference.refresh()
        return {"ref/refreshes": float(self.reference.refreshes)}

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        clock = {"rollout": 0.0, "reward": 0.0, "skipped": 0.0}
        batch = self.producer.collect(self.step, clock)
        t2 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        # dynamic sampling may end a step without one informative group: then nothing to learn;
        # its groups are global (every rank holds all): each rank trains on its equal share
        train = batch.train
        if train is not None and self.config.sampling.dynamic:
            train = rank_groups(train, self.dist.rank, self.dist.world_size)
        update = self.optimize(train) if train is not None else {"optim/skipped": 1.0}
        metrics = self.refresh_reference()
        t3 = time.perf_counter()
        # metrics over every group rolled out (all ranks, global order): the kept ones are biased
        everyone = batch.seen if self.config.sampling.dynamic else gather_scored(batch.seen)
        # every rank sees the same gathered counts, so every rank stops at the same step
        self.reward_errors.observe(
            self.step, everyone.errors, everyone.rewards.numel(), announce=self.dist.is_main
        )
        metrics.update(step_metrics(everyone))
        metrics.update(update)
        metrics.update(
            sampling_metrics(
                batch,
                self.config.sampling.dynamic,
                self.config.sampling.greso,
                clock["skipped"],
                self.config.rollout.group_size,
            )
        )
        metrics["rollout/temperature"] = clock["temperature"]
        self.producer.temperature.observe(metrics)  # adaptive: the next rollout's temperature
        # the new weights (and that temperature) to the engine, or to the producer process
        try:
            self.producer.sync_weights(self.step, changed=train is not None)
        except RolloutLost as lost:  # a rollout server gone: this step is done, then stop
            self.lost = lost
        tokens = float(everyone.rollout.completion_mask.sum())
        metrics.update(
            {
                "lr": lr,
                "time/rollout_s": clock["rollout"],
                "time/reward_s": clock["reward"],
                "time/train_s": t3 - t2,
                "tokens_per_s": tokens / max(t3 - t0, 1e-9),
            }
        )
        if "staleness" in clock:  # a producer process made this step's groups ahead
            metrics.update(
                {
                    # one version per step: every rollout of it was sampled with the same weights
                    "staleness/mean": clock["staleness"],
                    "staleness/max": clock["staleness"],
                    "time/wait_rollout_s": clock["wait_rollout"],
                    "time/wait_train_s": clock["wait_train"],
                }
            )
        metrics.update(self.hack_watch.observe(self.step, everyone, metrics, self.dist.is_main))
        if self.dist.is_main:
            # the groups trained on when dynamic sampling kept a subset, else all rolled out
            subset = batch.train is not None and batch.train is not batch.seen
            shown = batch.train if subset else everyone
            records = completion_records(shown, self.step, self.config.train.log_completions)
            if records:
                self.run.write_completions(self.step, records)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics


def train(
    config: Config | str | None = None,
    engine: RolloutEngine | None = None,
    *,
    rewards: Sequence[RewardItem] | None = None,
    dataset: Any = None,
    eval_dataset: Any = None,
    model: nn.Module | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Train with ``config`` (a Config, a recipe's path, or None: the default recipe); returns
    the run directory.

    ``rewards`` (callables, reward names or specs), ``dataset`` and ``eval_dataset``
    (``datasets.Dataset`` or lists of dicts), ``model`` and ``tokenizer`` replace what the
    config names (``grpo.training.given``). Under ``torchrun`` every process calls this; the
    process group is closed at the end.
    """
    if not isinstance(config, Config):
        config = load_config(config)
    config, given = given_parts(config, rewards, dataset, eval_dataset, model, tokenizer)
    try:
        return Trainer(config, engine, given).train()
    finally:
        distributed.shutdown()
