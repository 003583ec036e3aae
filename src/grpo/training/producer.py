"""Where a step's scored groups come from: prompts drawn from the stream (past the GRESO filter),
rolled out by the engine at the step's temperature, scored by the rewards, with the configured
estimator's advantages (``grpo.training.advantages``); dynamic sampling's rounds until the step
has enough informative groups.

The trainer asks a ``Producer`` for one step's groups (``collect``, a ``ProducedStep``), updates,
and hands the new weights back (``sync_weights``). ``InProcessProducer`` makes them here; with
``rollout.max_staleness >= 1`` it runs in a process of its own, ahead of the trainer
(``grpo.training.producer_process``). What the producer draws and skips is part of a checkpoint
(``state_dict``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from grpo import algorithm
from grpo.config import Config
from grpo.data.curriculum import Curriculum
from grpo.data.prompts import PromptFormat
from grpo.data.stream import Draw, PromptStream, sampling_seed
from grpo.rewards import RewardOutput, RewardRunner
from grpo.rewards.inputs import reward_inputs
from grpo.rollout import RolloutEngine, release
from grpo.runtime import distributed
from grpo.runtime.distributed import DistInfo
from grpo.runtime.precision import bf16_autocast
from grpo.step_data import Rollout, Scored
from grpo.training import advantages
from grpo.training.gather import empty_rollout, gather_scored
from grpo.training.prompt_selection import Collected, PromptFilter, collect, draw_prompts
from grpo.training.temperature import TemperatureController


@dataclass
class Ahead:
    """How a step made ahead by the producer process (``rollout.max_staleness``) came about.

    staleness: optimizer steps between the weights that sampled it and those it updates;
    wait_rollout_s: the trainer's wait for it; wait_train_s: the producer's wait for the weights
    to sample it with.
    """

    staleness: float
    wait_rollout_s: float
    wait_train_s: float


@dataclass
class ProducedStep:
    """One step's groups as the trainer receives them.

    collected: the scored groups (and what dynamic sampling did); temperature: the one they were
    sampled at; rollout_s / reward_s: seconds generating and scoring, over every round;
    skipped: prompts GRESO skipped; ahead: made by the producer process, else None.
    """

    collected: Collected
    temperature: float
    rollout_s: float
    reward_s: float
    skipped: float
    ahead: Ahead | None = None


@dataclass
class Round:
    """One round of sampling: seconds rolling out and scoring, prompts GRESO skipped."""

    rollout_s: float
    reward_s: float
    skipped: int


class Producer(Protocol):
    """What the trainer asks of a producer of steps: ``InProcessProducer`` here, or
    ``grpo.training.producer_process.ProducerProcess`` ahead in another process."""

    temperature: TemperatureController  # the trainer observes each step (adaptive)
    curriculum: Curriculum | None  # data.curriculum: the trainer observes each step

    def collect(self, step: int) -> ProducedStep:
        """Step ``step``'s (1-based) groups."""
        ...

    def sync_weights(self, step: int, changed: bool) -> None:
        """After step ``step``: later steps sample from the policy's weights now."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The data position (``consumed``, ``greso``, ``temperature``, ``curriculum``) a
        checkpoint holds."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class InProcessProducer:
    """Rolls out and scores the prompts of each step, in step order."""

    def __init__(
        self,
        config: Config,
        dist: DistInfo,
        rows: list[dict[str, Any]],
        prompt_format: PromptFormat,
        tokenizer: PreTrainedTokenizerBase,
        policy: nn.Module,
        engine: RolloutEngine,
        rewards: RewardRunner,
        curriculum: Curriculum | None = None,
    ) -> None:
        """``curriculum``: rows drawn at its level by stream position (``rows`` then only
        count the stream's epochs), else ``rows`` by the stream's index."""
        self.config, self.dist, self.rows = config, dist, rows
        self.curriculum = curriculum
        self.prompt_format, self.tokenizer, self.policy = prompt_format, tokenizer, policy
        self.engine, self.rewards = engine, rewards
        self.stream = PromptStream(rows, config.train.seed, config.data.shuffle)
        self.temperature = TemperatureController(config)
        sampling = config.sampling
        self.prompt_filter = (
            PromptFilter(sampling.greso_history, sampling.greso_skip_prob, config.train.seed)
            if sampling.greso
            else None
        )
        self.step = 0  # the step whose groups are being produced: its temperature

    def rollout(self, draws: list[Draw] | None = None) -> Rollout:
        """Roll out the drawn prompts (default: the next prompts_per_step of the stream)."""
        # every rank draws the same global batch and keeps its own slice of whole groups
        if draws is None:
            draws = [self.stream.next_draw() for _ in range(self.config.rollout.prompts_per_step)]
        start, stop = distributed.shard_bounds(len(draws), self.dist.rank, self.dist.world_size)
        if start == stop:  # a dynamic-sampling round with fewer prompts than ranks
            return empty_rollout(self.config.rollout.group_size)
        rows = [self.row(d) for d in draws[start:stop]]
        seeds = [sampling_seed(self.config.train.seed, d.position) for d in draws[start:stop]]
        prompts = [self.prompt_format.render(self.tokenizer, r) for r in rows]
        # HF generate on an FSDP2 policy needs whole weights: ranks stop decoding at different steps
        gather = self.config.rollout.engine == "hf"
        params = distributed.full_parameters(self.policy) if gather else contextlib.nullcontext()
        with params, bf16_autocast(self.dist.device, self.config.model.autocast):
            return self.engine.generate(
                prompts,
                rows,
                self.config.rollout.group_size,
                seeds=seeds,
                temperature=self.temperature.for_step(self.step),
            )

    def row(self, draw: Draw) -> dict[str, Any]:
        if self.curriculum is not None:
            return self.curriculum.row(draw.position)
        return self.rows[draw.index]

    def score(self, rollout: Rollout) -> Scored:
        if rollout.rows:
            out = self.rewards(*reward_inputs(rollout))
        else:  # this rank has no prompt this round; it still joins the collectives below
            names = self.rewards.names
            out = RewardOutput(torch.zeros(0, len(names)), names, torch.zeros(len(names)), {})
        # batch statistics over every rank's completions (groups are whole on each rank)
        adv = advantages.rank_advantages(
            self.config.algorithm, rollout, out.total, out.per_function, out.weights
        )
        return Scored(rollout, out.per_function, out.names, out.total, adv, out.errors)

    def recomputed_advantages(self, scored: Scored) -> Tensor:
        """The advantages of a batch of whole groups that every rank holds (dynamic sampling's
        kept groups)."""
        algo = self.config.algorithm
        return advantages.batch_advantages(
            algo,
            self.config.rollout.group_size,
            scored.rewards,
            scored.per_function,
            self.rewards.weights,
            advantages.counted_mask(scored.rollout, algo).sum(dim=1),
        )

    def sample(self, n: int) -> tuple[Scored, Round]:
        """Draw n prompts past the GRESO filter, roll them out and score them; with the round's
        seconds and skips."""
        t0 = time.perf_counter()
        draws, skipped = draw_prompts(
            self.stream.next_draw, n, self.prompt_filter, max_skips=len(self.rows)
        )
        rollout = self.rollout(draws)
        t1 = time.perf_counter()
        scored = self.score(rollout)
        spent = Round(t1 - t0, time.perf_counter() - t1, skipped)
        if self.prompt_filter is not None:
            # global rewards, so every rank keeps the same history and skips the same prompts
            rewards = distributed.all_gather_rows(scored.rewards)
            flags = algorithm.zero_std_groups(rewards, rollout.group_size).tolist()
            for draw, zero_variance in zip(draws, flags, strict=True):
                self.prompt_filter.record(draw.index, zero_variance)
        if self.config.sampling.dynamic:
            # every rank keeps the global groups: all make the same choices (prompt_selection)
            return gather_scored(scored), spent
        return scored, spent

    def collect(self, step: int) -> ProducedStep:
        """Step ``step``'s groups: one round, or dynamic sampling's rounds (prompt_selection)."""
        self.step = step
        temperature = self.temperature.for_step(step)
        rounds: list[Round] = []

        def sample(n: int) -> Scored:
            scored, spent = self.sample(n)
            rounds.append(spent)
            return scored

        collected = collect(
            sample,
            self.config.rollout.prompts_per_step,
            dynamic=self.config.sampling.dynamic,
            max_rounds=self.config.sampling.max_rounds,
            advantages=self.recomputed_advantages,
            multiple_of=self.dist.world_size,
        )
        return ProducedStep(
            collected,
            temperature,
            rollout_s=sum(r.rollout_s for r in rounds),
            reward_s=sum(r.reward_s for r in rounds),
            skipped=float(sum(r.skipped for r in rounds)),
        )

    def sync_weights(self, step: int, changed: bool) -> None:
        """After step ``step``: the engine samples from the policy's new weights (when the step
        changed them) from now on."""
        if changed:
            self.engine.sync_weights(self.policy)

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.stream.consumed,
            "greso": None if self.prompt_filter is None else self.prompt_filter.state_dict(),
            "temperature": self.temperature.state_dict(),
            "curriculum": None if self.curriculum is None else self.curriculum.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get(
            "ahead"
        ):  # saved with rollout.max_staleness >= 1 (grpo.training.producer_process)
            steps = [p.step for p in state["ahead"]]
            print(
                f"grpo: dropping the rollouts made ahead for steps {min(steps)}-{max(steps)} "
                "(rollout.max_staleness is 0 now): their prompts are not trained on",
                file=sys.stderr,
                flush=True,
            )
            state = state["ahead"][-1].state
        if self.prompt_filter is not None and state.get("greso"):
            self.prompt_filter.load_state_dict(state["greso"])
        if state.get("temperature"):
            self.temperature.load_state_dict(state["temperature"])
        if self.curriculum is not None and state.get("curriculum"):
            self.curriculum.load_state_dict(state["curriculum"])
        self.stream.consumed = state["consumed"]

    def close(self) -> None:
        """Release the engine (the rewards belong to whoever built them)."""
        release(self.engine)
