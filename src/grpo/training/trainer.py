"""The training loop: wires rollout, rewards, advantages, log-probs and the loss. No formula here.

One step: P prompts -> G completions each -> rewards -> group advantages -> (reference and old
log-probs, only when needed) -> ``num_iterations`` optimizer steps, each accumulating gradients
over length-sorted micro-batches -> metrics, sampled completions, checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor, nn

from grpo import algorithm
from grpo.config import Config, ConfigError, dump_config
from grpo.containers import Rollout, Scored
from grpo.data import DataError, load_dataset_rows, system_prompt_for
from grpo.data.prompts import prompt_format_for
from grpo.eval import evaluate, evaluate_with_tools, heldout_rows, settings_for
from grpo.models import (
    Reference,
    is_lora,
    load_policy,
    load_tokenizer,
    resolve_model_path,
    save_hf,
)
from grpo.rewards import ErrorWatch, RewardError, RewardOutput, RewardRunner
from grpo.rollout import RolloutEngine, build_engine, close_engine, reward_inputs
from grpo.rollout.turns import MultiTurnEngine, chat_tools, tool_metrics
from grpo.runs.directory import (
    FIXED_KEYS,
    Checkpoint,
    RunDir,
    RunDirError,
    config_changes,
    describe_changes,
    input_changes,
    is_disk_full,
    math_changes,
    model_digest,
    moot_change,
    rows_digest,
)
from grpo.runs.metrics import MetricsLogger, ProgressBar, reflection_rate
from grpo.runtime import distributed
from grpo.runtime.host_memory import set_malloc_policy
from grpo.scoring.distribution import Sampling
from grpo.scoring.logprobs import chunked_head_slot, completion_logprobs, full_logits, scoring_path
from grpo.training.prompt_selection import (
    Collected,
    Draw,
    PromptFilter,
    collect,
    draw_prompts,
    rank_groups,
)
from grpo.training.temperature import TemperatureController

# the gradient of beta * (logp - ref_logp) is beta * grad(logp), whose mean over sampled tokens
# is zero: in the loss, k1 does not pull the policy towards the reference
K1_WARNING = (
    "warning: algorithm.kl_estimator=k1 in the loss adds only zero-mean noise to the gradient "
    "(it does not pull towards the reference); use k3 (default) or k2"
)


# --------------------------------------------------------------------------------------- prompts


class PromptStream:
    """An endless, seeded stream of dataset rows, reshuffled every epoch.

    The state is one integer (rows consumed), so resuming needs nothing else.
    """

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool) -> None:
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def next_draw(self) -> Draw:
        """The next row: its index in ``rows``, its epoch and its position in the stream."""
        epoch, pos = divmod(self.consumed, len(self.rows))
        self.consumed += 1
        return Draw(self._order(epoch)[pos], epoch, self.consumed - 1)

    def take(self, n: int) -> list[dict[str, Any]]:
        return [self.rows[self.next_draw().index] for _ in range(n)]


def sampling_seed(seed: int, position: int) -> int:
    """Seed of the G samples of the prompt drawn at stream ``position`` (unique over a run).

    Depends on neither the rank nor the batch the prompt lands in, so W ranks sample exactly what
    one process with the same global batch samples, and a resumed run what an uninterrupted one does.
    """
    return (seed << 40) ^ position


# --------------------------------------------------------------------------------------- batches


@dataclass
class MicroBatch:
    """Views of a scored rollout for one forward/backward. Shapes [b, S'] / [b, T'] / [b]."""

    index: Tensor
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    loss_mask: Tensor  # completion_mask without tool outputs and template tokens (multi-turn)
    advantages: Tensor
    sampling: Sampling  # the controls the rollout was sampled under: the log-probs' distribution

    def to(self, device: torch.device) -> MicroBatch:
        tensors = [getattr(self, f.name).to(device) for f in dataclasses.fields(self)[:-1]]
        return MicroBatch(*tensors, self.sampling)


def micro_batch_order(prompt_len: Tensor, completion_len: Tensor, group_size: int) -> Tensor:
    """Row order for micro-batches: whole groups, longest group first. A group's completions pack
    behind one copy of its prompt (``logprobs.pack``), and groups of similar length share a
    micro-batch, so little is padded. [N] lengths, groups contiguous -> [N] order."""
    packed = prompt_len.view(-1, group_size)[:, 0] + completion_len.view(-1, group_size).sum(dim=1)
    groups = torch.argsort(packed, descending=True, stable=True)  # [P]
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


def cut_micro_batches(
    prompt_len: list[int],
    completion_len: list[int],
    order: list[int],
    group_size: int,
    size: int,
    max_tokens: int | None = None,
    count: int = 1,
) -> list[list[int]]:
    """Cut rows (taken in ``order``) into micro-batches of at most ``size`` rows and, with
    ``max_tokens``, at most that many packed positions (a group's prompt once per micro-batch,
    plus its completions; a row larger than the budget goes alone). Then, while there are fewer
    than ``count`` micro-batches, the one with most positions is halved (ranks must run the same
    number of backward passes). Returns row indices per micro-batch."""
    budget = max_tokens or math.inf
    cuts: list[list[int]] = []
    tokens: list[int] = []
    groups: set[int] = set()
    for row in order:
        group = row // group_size
        cost = completion_len[row] + (0 if group in groups else prompt_len[row])
        if not cuts or len(cuts[-1]) == size or tokens[-1] + cost > budget:
            cuts.append([])
            tokens.append(0)
            groups = set()
            cost = completion_len[row] + prompt_len[row]
        cuts[-1].append(row)
        tokens[-1] += cost
        groups.add(group)
    while len(cuts) < count:
        splittable = [k for k, rows in enumerate(cuts) if len(rows) > 1]
        if not splittable:
            raise RuntimeError(f"{len(order)} rows cannot make the {count} micro-batches of a rank")
        k = max(splittable, key=lambda k: tokens[k])
        rows, half = cuts[k], len(cuts[k]) // 2
        cuts[k : k + 1] = [rows[:half], rows[half:]]
        share = tokens[k] * half // len(rows)  # an estimate is enough to pick the next to halve
        tokens[k : k + 1] = [share, tokens[k] - share]
    return cuts


def micro_batches(
    rollout: Rollout,
    advantages: Tensor,
    size: int,
    max_tokens: int | None = None,
    count: int = 1,
) -> list[MicroBatch]:
    """Split into micro-batches (see ``micro_batch_order`` and ``cut_micro_batches``), each
    trimmed of pure padding."""
    prompt_len = rollout.prompt_mask.sum(dim=1)
    completion_len = rollout.completion_mask.sum(dim=1)
    order = micro_batch_order(prompt_len, completion_len, rollout.group_size)
    cuts = cut_micro_batches(
        prompt_len.tolist(),
        completion_len.tolist(),
        order.tolist(),
        rollout.group_size,
        size,
        max_tokens,
        count,
    )
    out = []
    for rows in cuts:
        idx = torch.tensor(rows, dtype=torch.long)
        pm, cm = rollout.prompt_mask[idx], rollout.completion_mask[idx]
        s_keep = int(pm.sum(dim=1).max())  # prompts are left padded: keep the last columns
        t_keep = max(int(cm.sum(dim=1).max()), 1)  # completions right padded: keep the first
        out.append(
            MicroBatch(
                index=idx,
                prompt_ids=rollout.prompt_ids[idx, -s_keep:],
                prompt_mask=pm[:, -s_keep:],
                completion_ids=rollout.completion_ids[idx, :t_keep],
                completion_mask=cm[:, :t_keep],
                loss_mask=rollout.loss_mask[idx, :t_keep],
                advantages=advantages[idx],
                sampling=rollout.sampling,
            )
        )
    return out


def _scatter(dest: Tensor, mb: MicroBatch, values: Tensor) -> None:
    dest[mb.index, : values.shape[1]] = values


_EMPTY = (math.inf, -math.inf)  # the identities of min and max


class UpdateStats:
    """Statistics of an update, combined over micro-batches, passes and ranks.

    Means are weighted by the tokens they are over (the loss's counted tokens): a sum of
    value x tokens and a sum of tokens per metric, both summed over ranks, then divided, so a
    metric never divides a masked sum by tokens it did not count. Minima and maxima stay minima
    and maxima. The loss's statistics (clip fractions, ratio, KL) are recorded on every one of
    the ``num_iterations`` passes (the first pass's ratio is 1 by construction); entropy and the
    sampler mismatch describe the rollout and are recorded on the first pass.
    """

    LOSS_MEANS = ("clip_frac/low", "clip_frac/high", "kl", "ratio/mean")

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}  # key -> [sum of value x tokens, tokens]
        self.extremes: dict[str, tuple[str, float]] = {}

    def _add(self, key: str, weighted: float, tokens: float) -> None:
        total = self.sums.setdefault(key, [0.0, 0.0])
        total[0] += weighted
        total[1] += tokens

    def _extreme(self, key: str, op: str, value: float) -> None:
        old = self.extremes.get(key, (op, value))[1]
        self.extremes[key] = (op, min(old, value) if op == "min" else max(old, value))

    def add_pass(self, loss_stats: dict[str, Tensor], loss_mask: Tensor) -> None:
        """One micro-batch of any pass: ``policy_loss``'s statistics over loss_mask [b, T]."""
        tokens = float(loss_mask.sum())
        for key in self.LOSS_MEANS:
            if key in loss_stats:
                self._add(key, float(loss_stats[key]) * tokens, tokens)
        # with no counted token policy_loss's extremes are placeholders: record the identities
        # (every rank must reduce the same keys)
        low, high = (loss_stats["ratio/min"], loss_stats["ratio/max"]) if tokens else _EMPTY
        self._extreme("ratio/min", "min", float(low))
        self._extreme("ratio/max", "max", float(high))

    def add_rollout(
        self,
        entropy: Tensor,
        loss_mask: Tensor,
        pg_mask: Tensor | None,
        logp: Tensor,
        sampler_logp: Tensor | None,
    ) -> None:
        """One micro-batch of the first pass; entropy, masks, logp, sampler_logp: [b, T]."""
        mask = loss_mask.bool()
        tokens = float(mask.sum())
        self._add("entropy", float(entropy[mask].sum()), tokens)
        if pg_mask is not None:
            self._add("entropy/kept_frac", float(pg_mask.sum()), tokens)
        if sampler_logp is not None:
            gap = algorithm.logprob_mismatch(logp, sampler_logp, mask)
            self._add("tis/mismatch_mean", float(gap["mismatch_mean"]) * tokens, tokens)
            high = gap["mismatch_max"] if tokens else _EMPTY[1]
            self._extreme("tis/mismatch_max", "max", float(high))

    def reduce(self) -> dict[str, float]:
        """Metrics over every rank (NaN for a mean over no counted token)."""
        out = {}
        for key, (weighted, tokens) in self.sums.items():
            tokens_all = distributed.all_reduce(tokens)
            out[key] = distributed.all_reduce(weighted) / tokens_all if tokens_all else math.nan
        for key, (op, value) in self.extremes.items():
            value = distributed.all_reduce(value, op)
            out[key] = value if math.isfinite(value) else math.nan
        return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------- schedule


def lr_lambda(warmup: int, total: int, schedule: str) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


# --------------------------------------------------------------------------------------- stops


class TrainingStopped(Exception):
    """The run stopped on SIGINT / SIGTERM; ``checkpoint`` is the newest complete one (or None)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, at_once: bool) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        how = "at once (second Ctrl-C) in step" if at_once else "after step"
        saved = f"{checkpoint} is complete" if checkpoint else "no checkpoint was written"
        super().__init__(f"stopped by {name} {how} {step}: {saved}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the current step (``signum`` is set);
    a second SIGINT stops at once. Installed only in the main thread (Python's rule)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: bool = True) -> None:
        self.signum = 0
        self.announce = announce  # under torchrun only rank 0 says so
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.signum and self.announce:
            name = signal.Signals(signum).name
            print(
                f"grpo: {name}: stopping after this step and writing a checkpoint "
                "(Ctrl-C again stops at once)",
                file=sys.stderr,
                flush=True,
            )
        self.signum = self.signum or signum


def save_torch(obj: Any, path: Path) -> None:
    # through a Python file, so a full disk raises OSError(ENOSPC) (torch's own writer only says
    # "unexpected pos")
    with path.open("wb") as f:
        torch.save(obj, f)


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


# --------------------------------------------------------------------------------------- trainer


class Trainer:
    """Builds everything from a Config (validating before writing anything), then trains."""

    def __init__(self, config: Config, engine: RolloutEngine | None = None) -> None:
        set_malloc_policy(config.train.malloc)  # see grpo/memory.py
        self.config = config
        self.dist = distributed.init_from_env()
        if config.rollout.prompts_per_step % self.dist.world_size:
            raise ConfigError(
                f"rollout.prompts_per_step={config.rollout.prompts_per_step} must be divisible "
                f"by the number of processes ({self.dist.world_size}): each rank takes whole groups"
            )
        if (
            config.algorithm.beta > 0
            and config.algorithm.kl_estimator == "k1"
            and self.dist.is_main
        ):
            print(K1_WARNING, file=sys.stderr)
        if config.train.threads:
            torch.set_num_threads(config.train.threads)
        torch.manual_seed(config.train.seed)
        random.seed(config.train.seed)
        # everything that can fail on bad input happens before the run directory is touched
        self.rows = load_dataset_rows(config.data, config.train.seed)
        if config.rollout.tools and any("turns" in row for row in self.rows):
            raise DataError(
                f"{config.data.path or config.data.task}: column 'turns' has the name of the "
                "argument rewards get a tool rollout's turns in; rename it"
            )
        self.prompt_format = prompt_format_for(
            config.data, system_prompt_for(config.data), chat_tools(config.rollout)
        )
        self.eval_rows = (
            heldout_rows(config, config.train.eval_examples) if config.train.eval_every else []
        )
        self.rewards = RewardRunner(config.rewards)
        try:
            self.rewards.check_columns(self.rows)
        except RewardError:
            self.rewards.close()
            raise
        self.reward_errors = ErrorWatch(
            config.rewards.max_error_frac, config.rewards.error_patience
        )
        model_path = resolve_model_path(config.model.name)
        # what checkpoints fingerprint, so a resume sees inputs changed under the same names
        self.inputs = {
            # a task's rows follow from the config, which is compared anyway; a file can change
            "data": rows_digest(self.rows) if config.data.path is not None else None,
            "model": model_digest(model_path),
        }
        # the run directory is locked, and a resume checked, before the model loads
        self.run = RunDir(config.run_dir)
        # what a resume changes (all keys, for the history; those that change the math)
        self.config_changes: dict[str, tuple[Any, Any]] = {}
        self.forced_changes: dict[str, tuple[Any, Any]] = {}
        # nor transformers' bars (loading, writing weights), until train() ends
        self.bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
        if not config.train.progress:
            transformers.utils.logging.disable_progress_bar()
        try:
            self.resume_from = distributed.from_main(self._claim_run_dir)
            self._build(model_path, engine)
        except BaseException:
            self.run.release()
            if self.bars_were_on:
                transformers.utils.logging.enable_progress_bar()
            raise

    def _build(self, model_path: str, engine: RolloutEngine | None) -> None:
        config = self.config
        self.tokenizer = load_tokenizer(model_path)
        self.prompt_format.check(self.tokenizer, self.rows)
        self.policy = load_policy(config.model, model_path).to(self.dist.device)
        self.policy.train()
        algo = config.algorithm
        products = torch.bfloat16 if config.model.autocast else None
        alpha = algo.ref_mix_alpha if algo.ref_update_every > 0 else 1.0
        self.reference = Reference(self.policy, products, alpha) if algo.beta > 0 else None
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
        if self.dist.enabled and config.train.distributed == "fsdp" and frozen_copy is not None:
            distributed.fully_shard_model(frozen_copy, self.dist)
        self.engine = engine or build_engine(
            config.rollout.engine,
            model=self.policy,
            tokenizer=self.tokenizer,
            config=config.rollout,
        )
        if config.rollout.tools and not isinstance(self.engine, MultiTurnEngine):
            self.engine = MultiTurnEngine(self.engine, self.tokenizer, config.rollout)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.optim.lr,
            betas=config.optim.betas,
            weight_decay=config.optim.weight_decay,
            # no parameter-sized temporaries: 0.19x the foreach step's time on SmolLM2 (README,
            # Levers); FSDP2's sharded parameters take the default path
            fused=not (self.dist.enabled and config.train.distributed == "fsdp"),
        )
        total = config.train.steps * config.algorithm.num_iterations
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(config.optim.warmup_steps, total, config.optim.schedule),
        )
        self.stream = PromptStream(self.rows, config.train.seed, config.data.shuffle)
        self.temperature = TemperatureController(config)
        sampling = config.sampling
        self.prompt_filter = (
            PromptFilter(sampling.greso_history, sampling.greso_skip_prob, config.train.seed)
            if sampling.greso
            else None
        )
        self.step = 0
        self.saved_step = -1  # the step of the newest checkpoint on disk

    def _claim_run_dir(self) -> Checkpoint | None:
        """Rank 0: lock the run directory and pick the checkpoint to resume (None: start afresh).

        A resume whose config changes the math is refused unless train.resume=force.
        """
        run = self.run
        run.claim()
        mode = self.config.train.resume
        if mode == "never":
            return None
        if mode in ("auto", "force"):
            checkpoint = run.latest_checkpoint()
        else:
            checkpoint = run.checkpoint_at(Path(mode))
        left = run.previous_run()
        if checkpoint is None:
            if left:  # a fresh start would delete them: the user decides
                raise RunDirError(
                    f"{run.path} holds a run ({', '.join(left)}) with no checkpoint to resume; "
                    "set train.resume=never to start over, or another train.run_name"
                )
            if mode == "force":
                raise ConfigError(f"train.resume=force: no checkpoint in {run.checkpoints}")
            return None
        if not checkpoint.path.resolve().is_relative_to(run.checkpoints.resolve()) and left:
            raise RunDirError(
                f"train.resume: {checkpoint.path} is another run's checkpoint and {run.path} "
                f"holds a run of its own ({', '.join(left)}); set another train.run_name"
            )
        saved_world = checkpoint.world_size
        if saved_world != self.dist.world_size:
            raise ConfigError(
                f"checkpoint {checkpoint.path} was written by {saved_world} process(es); resume "
                f"it with the same number (this run has {self.dist.world_size})"
            )
        new = self.config.model_dump(mode="json")
        defaults = Config().model_dump(mode="json")
        forced = math_changes(checkpoint.config, new, defaults)
        model = self.inputs["model"]
        same_model = model is not None and checkpoint.inputs.get("model") == model
        forced = {
            key: change
            for key, change in forced.items()
            if not moot_change(key, change, new, same_model)
        }
        forced.update(input_changes(checkpoint.inputs, self.inputs))
        fixed = {key: change for key, change in forced.items() if key in FIXED_KEYS}
        if fixed:
            raise ConfigError(
                f"resuming {checkpoint.path}: {describe_changes(fixed)} cannot change on resume "
                "(the checkpoint's weights would not fit), not even with train.resume=force; "
                f"start a new run (train.run_name) with model.name={checkpoint.path}"
            )
        if checkpoint.step > self.config.train.steps:
            raise ConfigError(
                f"train.steps {self.config.train.steps} is below the step of {checkpoint.path} "
                f"({checkpoint.step}); raise it to train on"
            )
        if forced and mode != "force":
            how = (
                "set train.resume=force to apply the change, or train.resume=never to start over"
                if mode == "auto"
                else "a chosen checkpoint resumes with its own config: rewind to it first "
                f"(train.steps={checkpoint.step} and its config), then apply the change with "
                "train.resume=force"
            )
            raise ConfigError(
                f"resuming {checkpoint.path} with a config that changes the math: "
                f"{describe_changes(forced)}; {how}"
            )
        self.config_changes = {
            **config_changes(checkpoint.config, new, defaults),
            **input_changes(checkpoint.inputs, self.inputs),
        }
        self.forced_changes = forced
        return checkpoint

    # ----------------------------------------------------------------------------- stages

    def rollout(self, draws: list[Draw] | None = None) -> Rollout:
        """Roll out the drawn prompts (default: the next prompts_per_step of the stream)."""
        # every rank draws the same global batch and keeps its own slice of whole groups
        if draws is None:
            draws = [self.stream.next_draw() for _ in range(self.config.rollout.prompts_per_step)]
        start, stop = distributed.shard_bounds(len(draws), self.dist.rank, self.dist.world_size)
        if start == stop:  # a dynamic-sampling round with fewer prompts than ranks
            return empty_rollout(self.config.rollout.group_size)
        rows = [self.rows[d.index] for d in draws[start:stop]]
        seeds = [sampling_seed(self.config.train.seed, d.position) for d in draws[start:stop]]
        prompts = [self.prompt_format.render(self.tokenizer, r) for r in rows]
        # HF generate on an FSDP2 policy needs whole weights: ranks stop decoding at different steps
        gather = self.config.rollout.engine == "hf"
        params = distributed.full_parameters(self.policy) if gather else contextlib.nullcontext()
        with params, self._autocast():
            return self.engine.generate(
                prompts,
                rows,
                self.config.rollout.group_size,
                seeds=seeds,
                temperature=self.temperature.for_step(self.step),
            )

    def score(self, rollout: Rollout) -> Scored:
        g = rollout.group_size
        if rollout.rows:
            out = self.rewards(*reward_inputs(rollout))
        else:  # this rank has no prompt this round; it still joins the collectives below
            names = self.rewards.names
            out = RewardOutput(torch.zeros(0, len(names)), names, torch.zeros(len(names)), {})
        total = out.total
        # on every rank's rewards, so that scale_rewards=batch uses the global batch std; the
        # groups are whole on each rank, so group statistics are unchanged
        mine = distributed.rank_slice(len(total))
        advantages = algorithm.group_advantages(
            distributed.all_gather_rows(total),
            g,
            self.config.algorithm.scale_rewards,
            self.config.algorithm.adv_eps,
        )[mine]
        return Scored(rollout, out.per_function, out.names, total, advantages, out.errors)

    def sample(self, n: int, clock: dict[str, float]) -> Scored:
        """Draw n prompts past the GRESO filter, roll them out and score them.

        ``clock`` accumulates the step's rollout and reward seconds and the prompts skipped.
        """
        t0 = time.perf_counter()
        draws, skipped = draw_prompts(
            self.stream.next_draw, n, self.prompt_filter, max_skips=len(self.rows)
        )
        rollout = self.rollout(draws)
        t1 = time.perf_counter()
        scored = self.score(rollout)
        clock["rollout"] += t1 - t0
        clock["reward"] += time.perf_counter() - t1
        clock["skipped"] += skipped
        if self.prompt_filter is not None:
            # global rewards, so every rank keeps the same history and skips the same prompts
            rewards = distributed.all_gather_rows(scored.rewards)
            flags = algorithm.zero_std_groups(rewards, rollout.group_size).tolist()
            for draw, zero_variance in zip(draws, flags, strict=True):
                self.prompt_filter.record(draw.index, zero_variance)
        if self.config.sampling.dynamic:
            # every rank keeps the global groups: all make the same choices (see grpo.training.prompt_selection)
            return gather_scored(scored)
        return scored

    def collect(self, clock: dict[str, float]) -> Collected:
        """This step's groups: one round, or dynamic sampling's rounds (see grpo.training.prompt_selection)."""
        cfg = self.config

        def advantages(rewards: Tensor) -> Tensor:
            return algorithm.group_advantages(
                rewards, cfg.rollout.group_size, cfg.algorithm.scale_rewards, cfg.algorithm.adv_eps
            )

        return collect(
            lambda n: self.sample(n, clock),
            cfg.rollout.prompts_per_step,
            dynamic=cfg.sampling.dynamic,
            max_rounds=cfg.sampling.max_rounds,
            advantages=advantages,
            multiple_of=self.dist.world_size,
        )

    def _autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        """bf16 autocast over float32 weights when model.autocast is on (log-probs stay float32).

        ``cache``: keep each weight's bf16 cast for the whole context. Generation reuses it at
        every decoding step; a scoring forward uses each weight once, so there the cache only
        holds a bf16 copy of every trained weight until the forward ends (SmolLM2: 210 MiB, by
        arithmetic), where without it a cast lives as long as autograd needs it: not at all in
        a no-grad or checkpointed forward."""
        return torch.autocast(
            self.dist.device.type,
            dtype=torch.bfloat16,
            enabled=self.config.model.autocast,
            cache_enabled=cache,
        )

    def _logprobs(self, model: nn.Module, mb: MicroBatch, entropy: bool = False):
        with self._autocast(cache=False):
            return completion_logprobs(
                model,
                mb.prompt_ids,
                mb.prompt_mask,
                mb.completion_ids,
                mb.completion_mask,
                mb.sampling,
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
                        _scatter(ref, mb, self._logprobs(model, mb)[0])
            if self.config.algorithm.num_iterations > 1:
                old = torch.zeros(shape, device=self.dist.device)
                for mb in batches:
                    _scatter(old, mb, self._logprobs(self.policy, mb)[0])
        return ref, old

    def optimize(self, scored: Scored) -> dict[str, float]:
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
        keep = (
            ~rollout.truncated
            if cfg.mask_truncated_completions
            else torch.ones_like(rollout.truncated)
        )
        counted = rollout.loss_mask & keep[:, None]
        keep = keep.to(self.dist.device)
        normalizer = algorithm.Normalizer(
            num_sequences=rollout.num_completions,
            num_tokens=distributed.local_share_of_global(float(counted.sum())),
            num_micro_batches=len(batches),
            max_new_tokens=self.config.rollout.max_new_tokens,
        )
        sampler_all = rollout.sampler_logp
        if sampler_all is not None:
            sampler_all = sampler_all.to(self.dist.device)
        pg_masks: dict[int, Tensor] = {}  # micro-batch -> high-entropy tokens, fixed at iteration 0
        stats = UpdateStats()
        for iteration in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for k, mb in enumerate(batches):
                # gradients cross ranks once per optimizer step, with the last micro-batch
                with distributed.gradient_sync(self.train_model, enabled=k == len(batches) - 1):
                    t = mb.completion_ids.shape[1]
                    logp, entropy = self._logprobs(self.train_model, mb, entropy=iteration == 0)
                    old = logp.detach() if old_all is None else old_all[mb.index, :t]
                    ref = None if ref_all is None else ref_all[mb.index, :t]
                    sampler = None if sampler_all is None else sampler_all[mb.index, :t]
                    loss_mask = mb.loss_mask & keep[mb.index, None]
                    weights = None
                    if sampler is not None and cfg.tis_cap is not None:
                        weights = algorithm.truncated_importance_weights(old, sampler, cfg.tis_cap)
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
                        beta=cfg.beta,
                        loss_type=cfg.loss_type,
                        ratio_level=cfg.ratio_level,
                        kl_estimator=cfg.kl_estimator,
                        dual_clip=cfg.dual_clip,
                        normalizer=normalizer,
                        importance_weights=weights,
                        pg_mask=pg_masks.get(k),
                    )
                    loss.backward()
                    loss_total += float(loss.detach())
                stats.add_pass(loss_stats, loss_mask)
                if iteration == 0:
                    stats.add_rollout(entropy, loss_mask, pg_masks.get(k), old, sampler)
            grad_norm = self._clip_and_step()
            if iteration == 0:
                first_loss, first_norm = loss_total, grad_norm
        self.engine.sync_weights(self.policy)
        out = stats.reduce()
        # the loss is the sum of the ranks' shares of the step's mean loss
        out["loss"] = distributed.all_reduce(first_loss) / self.dist.world_size
        out["grad_norm"] = first_norm
        return out

    def _clip_and_step(self) -> float:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        max_norm = self.config.optim.max_grad_norm or math.inf
        norm = distributed.as_float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        finite = math.isfinite(norm)
        if finite:
            self.optimizer.step()
        elif self.dist.is_main:
            # an inf or NaN step would make every weight NaN (and the next rollout fail): the
            # weights stay as they are, as mixed precision's loss scaling skips such a step
            print(
                f"grpo: warning: step {self.step}: the gradient's norm is {norm} (not finite); "
                "the optimizer step is skipped, the weights are unchanged",
                file=sys.stderr,
                flush=True,
            )
        # free the gradients now, not at the next update: the rollout and the frozen log-probs
        # between the two then reuse their memory instead of growing the process (as TRL does)
        self.optimizer.zero_grad(set_to_none=True)
        if finite:
            self.scheduler.step()
        return norm

    # ----------------------------------------------------------------------------- bookkeeping

    def step_metrics(self, scored: Scored) -> dict[str, float]:
        rollout = scored.rollout
        g = rollout.group_size
        out: dict[str, float] = {
            "reward/mean": float(scored.rewards.mean()),
            "reward/std": float(scored.rewards.std(unbiased=False)),
            "frac_zero_std": float((algorithm.group_std(scored.rewards, g) < 1e-6).float().mean()),
            "advantage/abs_mean": float(scored.advantages.abs().mean()),
            "completion_len/mean": float(rollout.completion_mask.sum(dim=1).float().mean()),
            "truncated_frac": float(rollout.truncated.float().mean()),
            "reflection_rate": reflection_rate(rollout.completions),
        }
        if rollout.turns is not None:
            out.update(tool_metrics(rollout.turns))
        for k, name in enumerate(scored.function_names):
            column = scored.per_function[:, k]
            valid = column[~column.isnan()]
            out[f"reward/{name}/mean"] = float(valid.mean()) if valid.numel() else math.nan
            out[f"reward/{name}/std"] = (
                float(valid.std(unbiased=False)) if valid.numel() else math.nan
            )
            out[f"reward/{name}/errors"] = float(scored.errors.get(name, 0))
        return out

    def write_completions(self, scored: Scored) -> None:
        n = min(self.config.train.log_completions, scored.rollout.num_completions)
        if n == 0:
            return
        records = []
        for i in range(n):
            records.append(
                {
                    "step": self.step,
                    "prompt": scored.rollout.prompts[i],
                    "completion": scored.rollout.completions[i],
                    "reward": float(scored.rewards[i]),
                    "rewards": {
                        name: None if math.isnan(v) else v
                        for name, v in zip(
                            scored.function_names, scored.per_function[i].tolist(), strict=True
                        )
                    },
                    "advantage": float(scored.advantages[i]),
                    "truncated": bool(scored.rollout.truncated[i]),
                }
            )
            if scored.rollout.turns is not None:
                records[-1]["turns"] = scored.rollout.turns[i]
        self.run.write_completions(self.step, records)

    def _manifest_meta(self) -> dict[str, Any]:
        return {
            "world_size": self.dist.world_size,
            "run_config": self.config.model_dump(mode="json"),
            "inputs": self.inputs,
        }

    def save_checkpoint(self) -> None:
        """Write ``checkpoints/step-N`` (all ranks take part; rank 0 seals and renames it)."""
        tmp = self.run.checkpoint_temp(self.step)
        main = self.dist.is_main
        if main:
            self.run.fresh_temp(tmp)
        distributed.barrier()  # tmp exists before any rank writes into it
        with self.run.cleanup_on_error(tmp) if main else contextlib.nullcontext():
            self.save_model(tmp)
            optimizer = distributed.optimizer_state(self.policy, self.optimizer)  # all ranks
            if main:
                state = {
                    "step": self.step,
                    "consumed": self.stream.consumed,
                    "world_size": self.dist.world_size,
                    "optimizer": optimizer,
                    "scheduler": self.scheduler.state_dict(),
                    "rng": capture_rng(),
                    "greso": None
                    if self.prompt_filter is None
                    else self.prompt_filter.state_dict(),
                    "temperature": self.temperature.state_dict(),
                    "reference": None if self.reference is None else self.reference.state_dict(),
                    "trainable": {
                        k: v
                        for k, v in self.policy.state_dict().items()
                        if _is_trainable(self.policy, k)
                    }
                    if is_lora(self.policy)
                    else None,
                }
                save_torch(state, tmp / "trainer_state.pt")
            else:
                # ranks > 0 only add their RNG state; rank 0 writes everything else
                save_torch({"rng": capture_rng()}, tmp / f"rng-rank{self.dist.rank}.pt")
            distributed.barrier()  # every rank's files are in tmp
            if main:
                self.run.commit_checkpoint(
                    self.step, self._manifest_meta(), self.config.train.keep_last
                )
        distributed.barrier()
        self.saved_step = self.step
        self.run.intact = self.run.checkpoints / f"step-{self.step}"  # on every rank

    def save_final(self) -> None:
        """Write ``final/`` the way checkpoints are written (temp name, manifest, rename)."""
        tmp = self.run.final_temp()
        main = self.dist.is_main
        if main:
            self.run.fresh_temp(tmp)
        distributed.barrier()
        with self.run.cleanup_on_error(tmp) if main else contextlib.nullcontext():
            self.save_model(tmp)
            if main:
                self.run.commit_final(self.step, self._manifest_meta())
        distributed.barrier()  # the run is complete on disk before any rank returns

    def save_model(self, path: Path) -> None:
        """Rank 0 writes the HF folder; under FSDP2 every rank first helps gather the weights."""
        if distributed.is_fsdp(self.policy):
            state = distributed.full_state_dict(self.policy)
            if self.dist.is_main:
                path.mkdir(parents=True, exist_ok=True)
                self.policy.save_pretrained(path, state_dict=state)
                self.tokenizer.save_pretrained(path)
        elif self.dist.is_main:
            save_hf(self.policy, self.tokenizer, path)

    def load_checkpoint(self, path: Path) -> None:
        try:
            self._load_checkpoint(path)
        except (torch.OutOfMemoryError, torch.distributed.DistError):
            raise  # the machine's trouble, not the checkpoint's
        except (RuntimeError, ValueError, KeyError) as err:  # shapes, names, optimizer groups
            said = " ".join(str(err).split()) or type(err).__name__  # torch's spans lines
            raise RunDirError(
                f"checkpoint {path} does not fit the model {self.config.model.name} as "
                f"configured (were its files changed?): {said[:300]}"
            ) from None

    def _load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if state["trainable"] is not None:
            self.policy.load_state_dict(state["trainable"], strict=False)
        else:
            weights: dict[str, Tensor] = {}
            for file in sorted(path.glob("*.safetensors")):
                weights.update(load_file(file))
            missing, unexpected = distributed.load_full_state_dict(self.policy, weights)
            # tied weights (the LM head) are saved once under the embedding's name
            tied = set(getattr(self.policy, "_tied_weights_keys", None) or ())
            if unexpected or set(missing) - tied:
                raise ValueError(
                    f"checkpoint {path} does not match the model: "
                    f"{(unexpected or sorted(set(missing) - tied))[:3]}"
                )
        distributed.load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.apply_optim_config()
        if self.dist.is_main:
            restore_rng(state["rng"])
        else:
            restore_rng(
                torch.load(path / f"rng-rank{self.dist.rank}.pt", weights_only=False)["rng"]
            )
        if self.prompt_filter is not None and state.get("greso"):
            self.prompt_filter.load_state_dict(state["greso"])
        if state.get("temperature"):
            self.temperature.load_state_dict(state["temperature"])
        if self.reference is not None and state.get("reference"):
            self.reference.load_state_dict(state["reference"])
        self.stream.consumed = state["consumed"]
        self.step = self.saved_step = state["step"]
        self.run.intact = path
        self.engine.sync_weights(self.policy)  # the engine samples from the restored weights

    def apply_optim_config(self) -> None:
        """The config's optimizer settings over the restored ones (the same unless a resume was
        forced with new ones): lr, betas, weight decay; the schedule keeps its position."""
        cfg = self.config.optim
        groups = self.optimizer.param_groups
        for group in groups:
            group.update(initial_lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler.base_lrs = [cfg.lr] * len(groups)
        for group, factor in zip(groups, self.scheduler.lr_lambdas, strict=True):
            group["lr"] = cfg.lr * factor(self.scheduler.last_epoch)

    # ----------------------------------------------------------------------------- loop

    def open_run_dir(self) -> None:
        """Rank 0: the run directory as this run continues it (config, history, logs)."""
        run, checkpoint = self.run, self.resume_from
        if checkpoint is None:
            run.start_fresh()
        else:
            removed = run.rewind(self.step)  # before the logs: see its docstring
            run.prepare_logs(self.step)
            where = (
                checkpoint.path.relative_to(run.path)
                if checkpoint.path.is_relative_to(run.path)
                else checkpoint.path
            )
            print(f"grpo: resuming from {checkpoint.path} (step {checkpoint.step})", flush=True)
            if removed:
                print(f"grpo: removed what followed step {self.step}: {', '.join(removed)}")
            run.log_event(self.step, "resume", checkpoint=str(where))
            if self.forced_changes:
                changes = describe_changes(self.forced_changes)
                print(f"grpo: train.resume=force: from step {self.step} {changes}", flush=True)
            free = {k: v for k, v in self.config_changes.items() if k not in self.forced_changes}
            if free:
                print(f"grpo: from step {self.step} {describe_changes(free)}", flush=True)
        event = "start" if checkpoint is None else "resume"
        run.record_config(dump_config(self.config), self.step, event, self.config_changes)

    def train(self) -> Path:
        main = self.dist.is_main  # only rank 0 touches the run directory
        try:
            if self.resume_from is not None:
                self.load_checkpoint(self.resume_from.path)
            if main:
                self.open_run_dir()
            with StopSignals(announce=main) as stop:
                self._loop(stop)
        except KeyboardInterrupt:  # a second Ctrl-C
            raise TrainingStopped(signal.SIGINT, self.step, self.run.intact, True) from None
        except Exception as err:
            if is_disk_full(err) or self.run.nearly_full():
                raise RunDirError(self.run.disk_full_message(err)) from None
            raise
        finally:
            self.rewards.close()
            close_engine(self.engine)
            self.run.release()
            if self.bars_were_on:
                transformers.utils.logging.enable_progress_bar()
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
                        self.save_checkpoint()
                    raise TrainingStopped(signum, self.step, self.run.intact, False)
                self.step += 1
                metrics = self.train_step()
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                    metrics.update(self.held_out_eval())
                if logger:
                    logger.log(self.step, metrics)
                bar.update(self.step, metrics)
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save_checkpoint()
            if self.saved_step != self.step:
                self.save_checkpoint()
            if distributed.from_main(self.run.final_step) != self.step:
                self.save_final()
        finally:
            bar.close()
            if logger:
                logger.close()

    def held_out_eval(self) -> dict[str, float]:
        """``eval/*`` metrics of the current policy on the held-out rows (see grpo.eval)."""
        t0 = time.perf_counter()
        settings = settings_for(self.config, self.config.train.eval_samples)
        # every rank evaluates the same rows (FSDP2: on gathered weights, as for rollouts)
        with distributed.full_parameters(self.policy):
            args = (self.policy, self.tokenizer, self.eval_rows, self.prompt_format)
            if self.config.rollout.tools:  # greedy answers through the same tool loop
                result = evaluate_with_tools(*args, self.config.rollout, settings, self.rewards)
            else:
                result = evaluate(*args, settings, self.rewards)
        out = {f"eval/{key}": value for key, value in result.items()}
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def refresh_reference(self) -> dict[str, float]:
        """Every ``ref_update_every`` steps the reference takes the policy's weights."""
        every = self.config.algorithm.ref_update_every
        if not every or self.reference is None:
            return {}
        if self.step % every == 0:
            self.reference.refresh()
        return {"ref/refreshes": float(self.reference.refreshes)}

    def sampling_metrics(self, batch: Collected, clock: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.config.sampling.dynamic:
            out["sampling/prompts_drawn"] = float(batch.prompts_drawn)
            out["sampling/prompts_kept"] = float(batch.prompts_kept)
            out["sampling/rounds"] = float(batch.rounds)
        if self.prompt_filter is not None:
            out["greso/skipped"] = clock["skipped"]
            out["greso/rollouts_saved"] = clock["skipped"] * self.config.rollout.group_size
        return out

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        clock = {"rollout": 0.0, "reward": 0.0, "skipped": 0.0}
        batch = self.collect(clock)
        t2 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        # dynamic sampling may end a step without one informative group: then nothing to learn;
        # its groups are global (every rank holds all): each rank trains on its equal share
        train = batch.train
        if train is not None and self.config.sampling.dynamic:
            train = rank_groups(train, self.dist.rank, self.dist.world_size)
        update = self.optimize(train) if train is not None else {}
        metrics = self.refresh_reference()
        t3 = time.perf_counter()
        # metrics over every group rolled out (all ranks, global order): the kept ones are biased
        everyone = batch.seen if self.config.sampling.dynamic else gather_scored(batch.seen)
        # every rank sees the same gathered counts, so every rank stops at the same step
        self.reward_errors.observe(
            self.step, everyone.errors, everyone.rewards.numel(), announce=self.dist.is_main
        )
        metrics.update(self.step_metrics(everyone))
        metrics.update(update)
        metrics.update(self.sampling_metrics(batch, clock))
        metrics["rollout/temperature"] = self.temperature.for_step(self.step)
        self.temperature.observe(metrics)  # adaptive: the next step's temperature
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
        if self.dist.is_main:
            # the groups trained on when dynamic sampling kept a subset, else all rolled out
            subset = batch.train is not None and batch.train is not batch.seen
            self.write_completions(batch.train if subset else everyone)
        return metrics


def empty_rollout(group_size: int) -> Rollout:
    """A rollout of no prompts (a rank's share of a round smaller than the number of ranks)."""
    ids, mask = torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.bool)
    return Rollout(ids, mask, ids, mask, torch.zeros(0, dtype=torch.bool), [], [], [], group_size)


def _kind(value: Any) -> Any:
    """What a gathered field holds: a tensor's dtype, "list", or None."""
    if isinstance(value, Tensor):
        return value.dtype
    return "list" if isinstance(value, list) else None


def gather_scored(scored: Scored) -> Scored:
    """Every rank's scored groups concatenated in rank order (itself on one process).

    Row-aligned tensors and lists are gathered; reward function error counts are summed.
    Prompts stay left padded (to the widest rank's width), completions right padded, so the
    result can be trained on.
    """
    if not distributed.active():
        return scored

    def gather(obj: Any, skip: set[str]) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in skip:
                continue
            # a rank without prompts this round has None where the others have rows (sampler
            # log-probs, multi-turn masks and turns): it sends an empty value of their kind
            kinds = [k for k in distributed.all_gather_list([_kind(value)]) if k is not None]
            if not kinds:
                continue
            if value is None:
                value = [] if kinds[0] == "list" else torch.zeros(0, 1, dtype=kinds[0])
            if f.name in ("prompt_ids", "prompt_mask"):
                width = int(distributed.all_reduce(value.shape[1], "max"))
                value = torch.nn.functional.pad(value, (width - value.shape[1], 0))
            if isinstance(value, Tensor):
                out[f.name] = distributed.all_gather_rows(value)
            elif isinstance(value, list):
                out[f.name] = distributed.all_gather_list(value)
        return out

    # the sampling controls of a rank that sampled (a rank without prompts has the defaults)
    sampled = distributed.all_gather_list(
        [(scored.rollout.num_completions, scored.rollout.sampling)]
    )
    sampling = next((s for n, s in sampled if n), scored.rollout.sampling)
    gathered = gather(scored.rollout, {"sampling"})
    rollout = dataclasses.replace(scored.rollout, sampling=sampling, **gathered)
    errors = {
        name: int(distributed.all_reduce(scored.errors.get(name, 0)))
        for name in scored.function_names
    }
    fields = gather(scored, {"rollout", "function_names"})
    return dataclasses.replace(scored, rollout=rollout, errors=errors, **fields)


def _is_trainable(model: nn.Module, key: str) -> bool:
    return "lora_" in key


def train(config: Config, engine: RolloutEngine | None = None) -> Path:
    """Train with ``config``; returns the run directory.

    Under ``torchrun`` every process calls this; the process group is closed at the end.
    """
    try:
        return Trainer(config, engine).train()
    finally:
        distributed.shutdown()
