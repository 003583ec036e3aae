"""The training loop: wires rollout, rewards, advantages, log-probs and the loss. No formula here.

One step: P prompts -> G completions each -> rewards -> advantages (``advantages``) ->
(reference and old log-probs, only when needed; per-token advantages) -> ``num_iterations``
optimizer steps, each accumulating gradients over length-sorted micro-batches -> metrics,
sampled completions, checkpoint.

The parts come from ``grpo.build`` in one call (``run_parts``); the trainer wires them, with the
training state (``state``) as the one owner of what a checkpoint (``checkpoint``) keeps. The
resume decision (``resume``), micro-batches, update statistics, the optimizer, signals and
console noise each live in their own module of this package.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo import build
from grpo.build import RunInputs, RunParts
from grpo.config import Config, ConfigError, dump_config, load_config
from grpo.eval import evaluate, settings_for
from grpo.models import Reference
from grpo.rewards import ErrorWatch
from grpo.rollout import RolloutEngine, RolloutLost, release
from grpo.runs.directory import RunDir, RunDirError, is_disk_full
from grpo.runs.metrics import MetricsLogger, ProgressBar
from grpo.runtime import distributed
from grpo.runtime.host_memory import set_malloc_policy
from grpo.runtime.precision import bf16_autocast
from grpo.scoring.chunked_head import chunked_head_slot, full_logits
from grpo.scoring.logprobs import scoring_path
from grpo.step_data import Scored
from grpo.training.caller_parts import Given, RewardItem, given_parts
from grpo.training.checkpoint import WrittenWith, load_checkpoint, save_checkpoint, save_final
from grpo.training.console import TransformersBars, warn_about
from grpo.training.critic import Critic
from grpo.training.entropy_bonus import EntropyBonus
from grpo.training.gather import gather_scored
from grpo.training.hack_watch import HackWatch
from grpo.training.optimizer import build_optimizer
from grpo.training.producer import InProcessProducer, Producer
from grpo.training.producer_process import ProducerProcess
from grpo.training.prompt_selection import Collected, rank_groups
from grpo.training.resume import ResumePlan, fingerprints, open_run, plan_resume
from grpo.training.signals import StopSignals, TrainingStopped
from grpo.training.state import TrainingState
from grpo.training.step_metrics import completion_records, logged_metrics
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
        examples = [turn.content for turn in config.data.few_shot]
        hack_watch = HackWatch(config.train.hack_watch, config.rewards.functions, examples)
        self.reward_errors = ErrorWatch(
            config.rewards.max_error_frac, config.rewards.error_patience
        )
        # an environment whose code keeps failing stops the run by the same rule
        self.env_errors = ErrorWatch(
            config.rewards.max_error_frac, config.rewards.error_patience, "environment"
        )
        self.run = RunDir(config.run_dir)
        self.bars = TransformersBars(config.train.progress)  # until train() ends
        parts: RunParts | None = None
        try:
            # the run directory is locked, and a resume checked, before the model loads
            parts = build.run_parts(config, self.given, self.dist.device, self._claim_run_dir)
            self._wire(parts, hack_watch, engine)
        except BaseException:  # what was started is stopped: reward workers, the lock, the bars
            if parts is not None:
                parts.inputs.close()
            self.run.release()
            self.bars.restore()
            raise

    def _claim_run_dir(self, config: Config, inputs: RunInputs) -> None:
        """Between the checked inputs and the model: the inputs' fingerprints (checkpoints
        record them, so a resume sees inputs changed under the same names); then rank 0 locks
        the run directory and decides where the run starts (``self.plan``)."""
        self.fingerprints = fingerprints(
            config, inputs.rows, inputs.model_path, self.given, inputs.environment
        )

        def claim() -> ResumePlan:
            self.run.claim()
            return plan_resume(self.run, config, self.dist.world_size, self.fingerprints)

        self.plan: ResumePlan = distributed.from_main(claim)

    def _wire(self, parts: RunParts, hack_watch: HackWatch, engine: RolloutEngine | None) -> None:
        """The training-level objects over the run's parts, in the order that fixes what each
        draws from the random streams."""
        self.config = config = parts.config  # auto precision decided
        inputs = parts.inputs
        self.rows, self.eval_rows = inputs.rows, inputs.eval_rows
        self.prompt_format, self.tokenizer = inputs.prompt_format, parts.tokenizer
        self.rewards, self.verifier = inputs.rewards, inputs.verifier
        policy = parts.policy
        # training forwards go through the DDP wrapper / the FSDP2-sharded policy; generation and
        # saving use the policy (the same module, and the same object under FSDP2)
        self.train_model = self._scoring_models(policy, parts.reference)
        self.producer = self._producer(parts, engine)
        fsdp = self.dist.enabled and config.train.distributed == "fsdp"
        optimizer, scheduler = build_optimizer(
            policy,
            config.optim,
            config.train.steps * config.algorithm.num_iterations,
            fused=not fsdp,
        )
        entropy_bonus = EntropyBonus(config.algorithm)
        self.state = TrainingState(
            policy,
            optimizer,
            scheduler,
            reference=parts.reference,
            critic=self._critic(policy),
            entropy_bonus=entropy_bonus,
            hack_watch=hack_watch,
            producer=self.producer,
        )
        self.update = PolicyUpdate(config, self.dist, self.state, self.train_model)
        self.saved_step = -1  # the step of the newest checkpoint on disk
        self.lost: RolloutLost | None = None  # generation elsewhere failed after an update

    def _scoring_models(self, policy: nn.Module, reference: Reference | None) -> nn.Module:
        """The model training forwards go through (DDP / FSDP2); the policy and the
        reference's copy score from their full logits when ``model.chunked_head`` is off."""
        config = self.config
        train_model = distributed.wrap_model(policy, config.train.distributed, self.dist)
        frozen_copy = reference.copy if reference is not None else None
        if not config.model.chunked_head:
            for model in (policy, frozen_copy):
                if model is not None:
                    full_logits(model)
        if self.dist.is_main:
            path, why = scoring_path(policy)
            head = "a chunk at a time" if chunked_head_slot(policy) else "full logits"
            print(f"scoring log-probs: {path} ({why}); LM head: {head}")
        fsdp = self.dist.enabled and config.train.distributed == "fsdp"
        if fsdp and frozen_copy is not None:
            distributed.fully_shard_model(frozen_copy, self.dist)
        return train_model

    def _critic(self, policy: nn.Module) -> Critic | None:
        """PPO's value model (``estimator: ppo``), on this process's device."""
        if self.config.algorithm.estimator != "ppo":
            return None
        if self.dist.enabled:
            raise ConfigError(
                "algorithm.estimator=ppo trains its critic in one process: not under torchrun "
                "(use grpo, rloo or reinforce_pp there)"
            )
        return Critic(self.config, policy, self.dist.device)

    def _producer(self, parts: RunParts, engine: RolloutEngine | None) -> Producer:
        """The producer of the steps' groups: in this process, or (``rollout.max_staleness``
        >= 1) ahead of it in another (``grpo.training.producer_process``). ``self.engine`` is
        the one held-out evaluation samples with (with a producer process: built only for it)."""
        config, inputs, policy, tokenizer = self.config, parts.inputs, parts.policy, parts.tokenizer
        if not config.rollout.max_staleness:
            self.engine = build.engine_of(config, policy, tokenizer, engine, inputs.environment)
            return InProcessProducer(
                config,
                self.dist,
                inputs.rows,
                inputs.prompt_format,
                tokenizer,
                policy,
                self.engine,
                inputs.rewards,
                inputs.curriculum,
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
            build.engine_of(here, policy, tokenizer, None, inputs.environment)
            if config.train.eval_every
            else None
        )
        return ProducerProcess(
            config,
            inputs.rows,
            self.given.rewards,
            inputs.model_path,
            policy,
            tokenizer,
            self.dist.device,
            self.given.environment,
        )

    # ----------------------------------------------------------------------------- update

    def optimize(self, scored: Scored) -> dict[str, float]:
        """The update on one scored batch (``grpo.training.update``)."""
        return self.update(scored, self.state.step).metrics

    # ----------------------------------------------------------------------------- state

    def resume_from(self, path: Path) -> None:
        """The training state from the checkpoint at ``path``; the engine samples from its
        weights."""
        load_checkpoint(self.state, path, dist=self.dist, config=self.config)
        self.saved_step = self.state.step
        self.run.intact = path
        self.producer.sync_weights(self.state.step, changed=True)

    def save(self) -> None:
        """A checkpoint of the step just done."""
        save_checkpoint(self.state, self.run, self._written_with())
        self.saved_step = self.state.step

    def _written_with(self) -> WrittenWith:
        """What a checkpoint or the final model is written with besides the state."""
        return WrittenWith(self.dist, self.tokenizer, self.config, self.fingerprints)

    # ----------------------------------------------------------------------------- loop

    def train(self) -> Path:
        main = self.dist.is_main  # only rank 0 touches the run directory
        try:
            if self.plan.checkpoint is not None:
                self.resume_from(self.plan.checkpoint.path)
            if main:
                open_run(self.run, self.plan, dump_config(self.config))
            with StopSignals(announce=main) as stop:
                self._loop(stop)
        except KeyboardInterrupt:  # a second Ctrl-C
            raise TrainingStopped(signal.SIGINT, self.state.step, self.run.intact, True) from None
        except Exception as err:
            if is_disk_full(err) or self.run.nearly_full():
                raise RunDirError(self.run.disk_full_message(err)) from None
            raise
        finally:
            self.producer.close()
            if self.engine is not None and self.engine is not getattr(
                self.producer, "engine", None
            ):
                release(self.engine)  # evaluation's own, beside a producer process
            self._close_rewards()
            self.run.release()
            self.bars.restore()
        return self.config.run_dir

    def _loop(self, stop: StopSignals) -> None:
        cfg = self.config.train
        main = self.dist.is_main
        logger = MetricsLogger(self.config.run_dir, cfg.sinks, self.state.step) if main else None
        bar = ProgressBar(cfg.steps, self.state.step, cfg.progress and main)
        try:
            if cfg.eval_every and self.state.step == 0:
                baseline = self.held_out_eval()  # the baseline every later eval compares to
                if logger:
                    logger.log(0, baseline)
            while self.state.step < cfg.steps:
                self._stop_if_signalled(stop)
                metrics = self._next_step()
                step = self.state.step
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    metrics.update(self.held_out_eval())
                if logger:
                    logger.log(step, metrics)
                bar.update(step, metrics)
                if cfg.save_every and step % cfg.save_every == 0:
                    self.save()
                if self.lost is not None:  # after the update: the step is logged and kept
                    self._stop_lost(self.lost, f"after step {step}")
            if self.saved_step != self.state.step:
                self.save()
            if distributed.from_main(self.run.final_step) != self.state.step:
                save_final(self.state, self.run, self._written_with())
        finally:
            bar.close()
            if logger:
                logger.close()

    def _stop_if_signalled(self, stop: StopSignals) -> None:
        """Stop, with a checkpoint of the steps done, when any rank got a signal: every rank
        stops after the same step, whichever got it."""
        signum = int(distributed.all_reduce(stop.signum, "max"))
        if signum:
            if self.state.step > 0 and self.saved_step != self.state.step:
                self.save()
            raise TrainingStopped(signum, self.state.step, self.run.intact, False)

    def _next_step(self) -> dict[str, float]:
        """The next step, counted; generation lost before its update keeps the steps done."""
        self.state.step += 1
        try:
            return self.train_step()
        except RolloutLost as lost:  # before the update: the steps done are kept
            self.state.step -= 1
            self._stop_lost(lost, f"before step {self.state.step + 1}")

    def _stop_lost(self, lost: RolloutLost, when: str) -> NoReturn:
        """Stop for generation that failed elsewhere: a checkpoint of the steps done, one line."""
        if self.state.step > 0 and self.saved_step != self.state.step:
            self.save()
        saved = f"{self.run.intact} is complete" if self.run.intact else "no checkpoint"
        raise type(lost)(f"{lost} {when}: {saved}") from None

    def held_out_eval(self) -> dict[str, float]:
        """``eval/*`` metrics of the current policy on the held-out rows (see grpo.eval)."""
        t0 = time.perf_counter()
        settings = settings_for(self.config, self.config.train.eval_samples)
        # every rank evaluates the same rows (FSDP2: on gathered weights, as for rollouts)
        with (
            distributed.full_parameters(self.state.policy),
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
        reference = self.state.reference
        if not every or reference is None:
            return {}
        if self.state.step % every == 0:
            reference.refresh()
        return {"ref/refreshes": float(reference.refreshes)}

    # ----------------------------------------------------------------------------- one step

    def train_step(self) -> dict[str, float]:
        """One step: produce its groups, update on them, log, keep sampled completions."""
        t0 = time.perf_counter()
        produced = self.producer.collect(self.state.step)
        t2 = time.perf_counter()
        lr = self.state.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        train = self._share(produced.collected.train)
        update = self.optimize(train) if train is not None else {"optim/skipped": 1.0}
        refreshed = self.refresh_reference()
        t3 = time.perf_counter()
        everyone = self._everyone(produced.collected)
        metrics = logged_metrics(
            produced,
            everyone,
            update,
            refreshed,
            lr=lr,
            train_s=t3 - t2,
            elapsed_s=t3 - t0,
            config=self.config,
        )
        self.producer.temperature.observe(metrics)  # adaptive: the next rollout's temperature
        metrics.update(self._observe_curriculum(everyone))
        self._sync_weights(changed=train is not None)
        main = self.dist.is_main
        metrics.update(self.state.hack_watch.observe(self.state.step, everyone, metrics, main))
        self._keep_completions(produced.collected, everyone)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def _observe_curriculum(self, everyone: Scored) -> dict[str, float]:
        """``data.curriculum``: this step's passes move the next step's level; its metrics."""
        curriculum = self.producer.curriculum
        if curriculum is None:
            return {}
        k = everyone.function_names.index(self.config.data.curriculum.reward)
        return curriculum.observe(everyone.per_function[:, k].tolist())

    def _share(self, train: Scored | None) -> Scored | None:
        """This rank's share of the groups to train on: dynamic sampling's are global (every
        rank holds all), and each rank trains on its equal share. None: dynamic sampling
        ended the step without one informative group, and there is nothing to learn."""
        if train is not None and self.config.sampling.dynamic:
            return rank_groups(train, self.dist.rank, self.dist.world_size)
        return train

    def _everyone(self, batch: Collected) -> Scored:
        """Every group rolled out this step (all ranks, global order), its reward errors
        counted: metrics are over these (the kept ones are biased)."""
        everyone = batch.seen if self.config.sampling.dynamic else gather_scored(batch.seen)
        # every rank sees the same gathered counts, so every rank stops at the same step
        n, main = everyone.rewards.numel(), self.dist.is_main
        self.reward_errors.observe(self.state.step, everyone.errors, n, announce=main)
        if everyone.rollout.episodes is not None:
            failed = sum(bool(e.failures) for e in everyone.rollout.episodes)
            name = self.config.rollout.environment or "python"
            self.env_errors.observe(self.state.step, {name: failed}, n, announce=main)
        return everyone

    def _sync_weights(self, changed: bool) -> None:
        """The new weights (and the temperature) to the engine, or to the producer process."""
        try:
            self.producer.sync_weights(self.state.step, changed=changed)
        except RolloutLost as lost:  # a rollout server gone: this step is done, then stop
            self.lost = lost

    def _keep_completions(self, batch: Collected, everyone: Scored) -> None:
        """Rank 0 writes the step's first completions: of the groups trained on when dynamic
        sampling kept a subset, else of all rolled out."""
        if not self.dist.is_main:
            return
        subset = batch.train is not None and batch.train is not batch.seen
        shown = batch.train if subset else everyone
        records = completion_records(shown, self.state.step, self.config.train.log_completions)
        if records:
            self.run.write_completions(self.state.step, records)


def train(
    config: Config | str | None = None,
    engine: RolloutEngine | None = None,
    *,
    rewards: Sequence[RewardItem] | None = None,
    dataset: Any = None,
    eval_dataset: Any = None,
    model: nn.Module | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    environment: Callable[[], Any] | None = None,
) -> Path:
    """Train with ``config`` (a Config, a recipe's path, or None: the default recipe); returns
    the run directory.

    ``rewards`` (callables, reward names or specs), ``dataset`` and ``eval_dataset``
    (``datasets.Dataset`` or lists of dicts), ``model``, ``tokenizer`` and ``environment`` (a
    class written to TRL's ``environment_factory`` contract, docs/environments.md) replace what
    the config names (``grpo.training.caller_parts``). Under ``torchrun`` every process calls this; the
    process group is closed at the end.
    """
    if not isinstance(config, Config):
        config = load_config(config)
    config, given = given_parts(
        config, rewards, dataset, eval_dataset, model, tokenizer, environment
    )
    try:
        return Trainer(config, engine, given).train()
    finally:
        distributed.shutdown()
