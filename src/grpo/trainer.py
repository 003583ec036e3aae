"""The training loop: wires rollout, rewards, advantages, log-probs and the loss. No formula here.

One step: P prompts -> G completions each -> rewards -> group advantages -> (reference and old
log-probs, only when needed) -> ``num_iterations`` optimizer steps, each accumulating gradients
over length-sorted micro-batches -> metrics, sampled completions, checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo import algorithm
from grpo.batch import Rollout, Scored
from grpo.config import Config, dump_config
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.logprobs import completion_logprobs
from grpo.metrics import MetricsLogger, ProgressBar, truncate_jsonl
from grpo.models import (
    Reference,
    is_lora,
    load_policy,
    load_tokenizer,
    resolve_model_path,
    save_hf,
)
from grpo.rewards import RewardRunner
from grpo.rollout import RolloutEngine, build_engine, render_prompt

CHECKPOINT_RE = re.compile(r"^step-(\d+)$")


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

    def take(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.consumed, len(self.rows))
            out.append(self.rows[self._order(epoch)[pos]])
            self.consumed += 1
        return out


# --------------------------------------------------------------------------------------- batches


@dataclass
class MicroBatch:
    """Views of a scored rollout for one forward/backward. Shapes [b, S'] / [b, T'] / [b]."""

    index: Tensor
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    advantages: Tensor


def micro_batches(rollout: Rollout, advantages: Tensor, size: int) -> list[MicroBatch]:
    """Split into micro-batches of similar completion length, each trimmed of pure padding."""
    lengths = rollout.completion_mask.sum(dim=1) + rollout.prompt_mask.sum(dim=1)
    order = torch.argsort(lengths, descending=True, stable=True)
    out = []
    for start in range(0, len(order), size):
        idx = order[start : start + size]
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
                advantages=advantages[idx],
            )
        )
    return out


def _scatter(dest: Tensor, mb: MicroBatch, values: Tensor) -> None:
    dest[mb.index, : values.shape[1]] = values


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


# --------------------------------------------------------------------------------------- run dir


def find_last_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (temp folders never match the name pattern)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and (p / "trainer_state.pt").is_file()
    ]
    return max(found)[1] if found else None


def resolve_resume(config: Config) -> Path | None:
    mode = config.train.resume
    if mode == "never":
        return None
    if mode == "auto":
        return find_last_checkpoint(config.run_dir)
    path = Path(mode)
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"train.resume: {path} is not a checkpoint folder")
    return path


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


# --------------------------------------------------------------------------------------- trainer


class Trainer:
    """Builds everything from a Config (validating before writing anything), then trains."""

    def __init__(self, config: Config, engine: RolloutEngine | None = None) -> None:
        self.config = config
        if config.train.threads:
            torch.set_num_threads(config.train.threads)
        torch.manual_seed(config.train.seed)
        random.seed(config.train.seed)
        # everything that can fail on bad input happens before the run directory is touched
        self.rows = load_dataset_rows(config.data, config.train.seed)
        self.system_prompt = system_prompt_for(config.data)
        self.rewards = RewardRunner(config.rewards)
        self.resume_from = resolve_resume(config)
        model_path = resolve_model_path(config.model.name)
        self.tokenizer = load_tokenizer(model_path)
        self.policy = load_policy(config.model, model_path)
        self.policy.train()
        self.reference = Reference(self.policy) if config.algorithm.beta > 0 else None
        self.engine = engine or build_engine(
            config.rollout.engine, model=self.policy, tokenizer=self.tokenizer, config=config.rollout
        )
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.optim.lr,
            betas=config.optim.betas,
            weight_decay=config.optim.weight_decay,
        )
        total = config.train.steps * config.algorithm.num_iterations
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(config.optim.warmup_steps, total, config.optim.schedule),
        )
        self.stream = PromptStream(self.rows, config.train.seed, config.data.shuffle)
        self.step = 0

    # ----------------------------------------------------------------------------- stages

    def rollout(self) -> Rollout:
        rows = self.stream.take(self.config.rollout.prompts_per_step)
        prompts = [render_prompt(self.tokenizer, r["prompt"], self.system_prompt) for r in rows]
        return self.engine.generate(prompts, rows, self.config.rollout.group_size)

    def score(self, rollout: Rollout) -> Scored:
        g = rollout.group_size
        columns: dict[str, list[Any]] = {}
        for key in rollout.rows[0]:
            if key != "prompt":
                columns[key] = [row.get(key) for row in rollout.rows for _ in range(g)]
        ids = [
            ids[mask].tolist()
            for ids, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ]
        prompts = [row["prompt"] for row in rollout.rows for _ in range(g)]
        out = self.rewards(rollout.completions, prompts, columns, ids)
        total = out.total
        advantages = algorithm.group_advantages(
            total, g, self.config.algorithm.scale_rewards, self.config.algorithm.adv_eps
        )
        return Scored(rollout, out.per_function, out.names, total, advantages, out.errors)

    def _logprobs(self, model: nn.Module, mb: MicroBatch, entropy: bool = False):
        return completion_logprobs(
            model,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.completion_ids,
            mb.completion_mask,
            self.config.rollout.temperature,
            with_entropy=entropy,
        )

    @torch.no_grad()
    def frozen_logprobs(self, batches: list[MicroBatch], shape: tuple[int, int]):
        """Reference log-probs (beta > 0) and old log-probs (mu > 1): [N, T] each, or None."""
        ref = old = None
        if self.reference is not None:
            ref = torch.zeros(shape)
            with self.reference.model() as model:
                for mb in batches:
                    _scatter(ref, mb, self._logprobs(model, mb)[0])
        if self.config.algorithm.num_iterations > 1:
            old = torch.zeros(shape)
            for mb in batches:
                _scatter(old, mb, self._logprobs(self.policy, mb)[0])
        return ref, old

    def optimize(self, scored: Scored) -> dict[str, float]:
        cfg = self.config.algorithm
        rollout = scored.rollout
        batches = micro_batches(rollout, scored.advantages, self.config.optim.micro_batch_size)
        shape = tuple(rollout.completion_ids.shape)
        ref_all, old_all = self.frozen_logprobs(batches, shape)
        mask_all = rollout.completion_mask
        normalizer = algorithm.Normalizer(
            num_sequences=rollout.num_completions,
            num_tokens=float(mask_all.sum()),
            num_micro_batches=len(batches),
            max_new_tokens=self.config.rollout.max_new_tokens,
        )
        sums: dict[str, float] = {}
        ratio_min, ratio_max = math.inf, -math.inf
        for iteration in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for mb in batches:
                t = mb.completion_ids.shape[1]
                logp, entropy = self._logprobs(self.policy, mb, entropy=iteration == 0)
                old = logp.detach() if old_all is None else old_all[mb.index, :t]
                ref = None if ref_all is None else ref_all[mb.index, :t]
                loss, stats = algorithm.policy_loss(
                    logp,
                    old,
                    mb.advantages,
                    mb.completion_mask,
                    ref,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    beta=cfg.beta,
                    loss_type=cfg.loss_type,
                    ratio_level=cfg.ratio_level,
                    kl_estimator=cfg.kl_estimator,
                    dual_clip=cfg.dual_clip,
                    normalizer=normalizer,
                )
                loss.backward()
                loss_total += float(loss.detach())
                if iteration == 0:
                    tokens = float(mb.completion_mask.sum())
                    for key in ("clip_frac/low", "clip_frac/high", "kl", "ratio/mean"):
                        if key in stats:
                            sums[key] = sums.get(key, 0.0) + float(stats[key]) * tokens
                    sums["entropy"] = sums.get("entropy", 0.0) + float(
                        (entropy * mb.completion_mask).sum()
                    )
                    ratio_min = min(ratio_min, float(stats["ratio/min"]))
                    ratio_max = max(ratio_max, float(stats["ratio/max"]))
            grad_norm = self._clip_and_step()
            if iteration == 0:
                first_loss, first_norm = loss_total, grad_norm
        self.engine.sync_weights(self.policy)
        tokens_all = max(float(mask_all.sum()), 1.0)
        out = {key: value / tokens_all for key, value in sums.items()}
        out.update({"ratio/min": ratio_min, "ratio/max": ratio_max})
        out.update({"loss": first_loss, "grad_norm": first_norm})
        return out

    def _clip_and_step(self) -> float:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        max_norm = self.config.optim.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)

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
        }
        for k, name in enumerate(scored.function_names):
            column = scored.per_function[:, k]
            valid = column[~column.isnan()]
            out[f"reward/{name}/mean"] = float(valid.mean()) if valid.numel() else math.nan
            out[f"reward/{name}/std"] = (
                float(valid.std(unbiased=False)) if valid.numel() else math.nan
            )
            out[f"reward/{name}/errors"] = float(scored.errors.get(name, 0))
        return out

    def write_completions(self, scored: Scored, run_dir: Path) -> None:
        n = min(self.config.train.log_completions, scored.rollout.num_completions)
        if n == 0:
            return
        folder = run_dir / "completions"
        folder.mkdir(exist_ok=True)
        with (folder / f"step-{self.step:06d}.jsonl").open("w") as f:
            for i in range(n):
                record = {
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
                f.write(json.dumps(record) + "\n")

    def save_checkpoint(self, run_dir: Path) -> Path:
        folder = run_dir / "checkpoints"
        final = folder / f"step-{self.step}"
        tmp = folder / f".tmp-step-{self.step}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(self.policy, self.tokenizer, tmp)
        state = {
            "step": self.step,
            "consumed": self.stream.consumed,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng(),
            "trainable": {
                k: v for k, v in self.policy.state_dict().items() if _is_trainable(self.policy, k)
            }
            if is_lora(self.policy)
            else None,
        }
        torch.save(state, tmp / "trainer_state.pt")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # atomic: a crash leaves either the old set or the complete new one
        kept = sorted(
            (int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_RE.match(p.name))
        )
        for _, old in kept[: -self.config.train.keep_last]:
            shutil.rmtree(old)
        return final

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if state["trainable"] is not None:
            self.policy.load_state_dict(state["trainable"], strict=False)
        else:
            weights: dict[str, Tensor] = {}
            for file in sorted(path.glob("*.safetensors")):
                weights.update(load_file(file))
            missing, unexpected = self.policy.load_state_dict(weights, strict=False)
            if unexpected:
                raise ValueError(f"checkpoint {path} does not match the model: {unexpected[:3]}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        self.stream.consumed = state["consumed"]
        self.step = state["step"]

    # ----------------------------------------------------------------------------- loop

    def train(self) -> Path:
        cfg = self.config.train
        run_dir = self.config.run_dir
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
        elif run_dir.exists():
            # a fresh start replaces the previous run's outputs instead of mixing with them
            for name in ("metrics.jsonl", "completions", "checkpoints", "final", "tensorboard"):
                target = run_dir / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(self.config))
        truncate_jsonl(run_dir / "metrics.jsonl", self.step)
        for stale in (run_dir / "completions").glob("step-*.jsonl"):
            if int(stale.stem.split("-")[1]) > self.step:
                stale.unlink()
        logger = MetricsLogger(run_dir, cfg.sinks, keep_through_step=self.step)
        bar = ProgressBar(cfg.steps, self.step, cfg.progress)
        try:
            while self.step < cfg.steps:
                self.step += 1
                metrics = self.train_step(run_dir)
                logger.log(self.step, metrics)
                bar.update(self.step, metrics)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save_checkpoint(run_dir)
            self.save_checkpoint(run_dir)
            final = run_dir / "final"
            shutil.rmtree(final, ignore_errors=True)
            save_hf(self.policy, self.tokenizer, final)
        finally:
            bar.close()
            logger.close()
            self.rewards.close()
        return run_dir

    def train_step(self, run_dir: Path) -> dict[str, float]:
        t0 = time.perf_counter()
        rollout = self.rollout()
        t1 = time.perf_counter()
        scored = self.score(rollout)
        t2 = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses
        update = self.optimize(scored)
        t3 = time.perf_counter()
        metrics = self.step_metrics(scored)
        metrics.update(update)
        tokens = float(rollout.completion_mask.sum())
        metrics.update(
            {
                "lr": lr,
                "time/rollout_s": t1 - t0,
                "time/reward_s": t2 - t1,
                "time/train_s": t3 - t2,
                "tokens_per_s": tokens / max(t3 - t0, 1e-9),
            }
        )
        self.write_completions(scored, run_dir)
        return metrics


def _is_trainable(model: nn.Module, key: str) -> bool:
    return "lora_" in key


def train(config: Config, engine: RolloutEngine | None = None) -> Path:
    """Train with ``config``; returns the run directory."""
    return Trainer(config, engine).train()
