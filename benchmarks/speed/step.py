"""Time N training steps of a set-up and write one JSON file.

    .venv/bin/python -m benchmarks.speed.step --setup smollm2 --steps 8 --out benchmarks/results/step_smollm2.json
    .venv/bin/python -m benchmarks.speed.step --setup tiny model.gradient_checkpointing=false train.malloc=return

Each step is split into rollout, reward, frozen log-probs (reference and old policy; only the
forwards the math needs run at all) and the policy update; the JSON also has generated and
trained tokens per second, peak RSS and an MFU estimate (see ``benchmarks/common.py``).
Dotted ``key=value`` overrides go to the grpo config, as on the ``grpo train`` command line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import grpo
from benchmarks import common, rewards
from grpo import build
from grpo.config import Config, build_config, merge_trees, parse_overrides
from grpo.models import resolve_model_path
from grpo.scoring.chunked_head import kept_positions
from grpo.training.trainer import Trainer

REWARDS_FILE = Path(rewards.__file__).resolve()


def config_tree(setup: dict[str, Any], steps: int, seed: int, output_dir: str) -> dict[str, Any]:
    """The grpo config of a benchmark set-up (the same knobs ``vs_trl`` gives TRL)."""
    return {
        "model": {
            "name": setup["model"],
            "gradient_checkpointing": setup["gradient_checkpointing"],
            "chunked_head": setup.get("chunked_head", True),
            # mixed precision as TRL's bf16=True: bf16 autocast over float32 weights
            "precision": "bf16_autocast" if setup["precision"] == "bfloat16" else "float32",
        },
        "data": setup["data"],
        "rollout": {
            "prompts_per_step": setup["prompts_per_step"],
            "group_size": setup["group_size"],
            "max_new_tokens": setup["max_new_tokens"],
        },
        "rewards": {
            "functions": [
                {"name": f"{REWARDS_FILE}:last_integer"},
                {"name": f"{REWARDS_FILE}:answer_tag"},
            ]
        },
        "algorithm": {"beta": setup["beta"], "loss_type": setup["loss_type"]},
        "optim": {"lr": setup["lr"], "micro_batch_size": setup["micro_batch_size"]},
        "train": {
            "steps": steps,
            "seed": seed,
            "output_dir": output_dir,
            "run_name": "bench",
            "resume": "never",
            "log_completions": 0,
            "sinks": ["jsonl"],
            "progress": False,
        },
    }


class StepClock:
    """Wraps a trainer's stages to record the rollout and the frozen log-prob time of a step, and
    counts the positions the update's forwards compute (forwards with gradients)."""

    def __init__(self, trainer: Trainer) -> None:
        self.frozen_s = 0.0
        self.scored = None
        self.positions = self.logits = 0
        frozen, score = trainer.update.frozen_logprobs, trainer.producer.score

        def timed_frozen(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return frozen(*args, **kwargs)
            finally:
                self.frozen_s += time.perf_counter() - t0

        def keep_scored(*args: Any, **kwargs: Any) -> Any:
            self.scored = score(*args, **kwargs)
            return self.scored

        def count(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if torch.is_grad_enabled():  # rollout and frozen log-probs run without gradients
                ids = kwargs["input_ids"]
                self.positions += ids.numel()
                # the head's positions, from the call: the chunked head's output is no logits
                self.logits += kept_positions(ids, kwargs.get("logits_to_keep", 0))

        optimize = trainer.optimize

        def counted_optimize(*args: Any, **kwargs: Any) -> Any:
            # hooked only while it optimizes: a hook on the policy would make the rollout decode
            # through the model's own forward (rollout/decode.py skips hooked modules)
            hook = trainer.state.policy.register_forward_hook(count, with_kwargs=True)
            try:
                return optimize(*args, **kwargs)
            finally:
                hook.remove()

        trainer.update.frozen_logprobs = timed_frozen
        trainer.producer.score = keep_scored
        trainer.optimize = counted_optimize

    def reset(self) -> None:
        self.frozen_s, self.scored = 0.0, None
        self.positions = self.logits = 0


# the trainer's methods StageMemory labels, and the stage each one is (``optimize`` holds the
# frozen log-probs: what it does besides them is the update)
# (the trainer's part, its method) -> the stage it runs in
STAGES = {
    ("producer", "rollout"): "rollout",
    ("update", "frozen_logprobs"): "frozen_logprobs",
    (None, "optimize"): "update",
}


class StageMemory:
    """Peak resident memory by stage of a step (rollout, frozen log-probs, the update's other
    work, the rest): where a run's peak RSS comes from.

    Read from the kernel's own high-water mark (``VmHWM``), which is reset at every stage
    boundary (``/proc/self/clear_refs``), so each stage's peak is exact and nothing samples on a
    thread: a 5 ms sampler thread took the GIL often enough to slow the HF rollout's Python-heavy
    decode loop by a quarter on 2 cores. A reset also resets the process's ``ru_maxrss``, so the
    run's peak is the largest stage peak (``peak_mb``); before the first stage, "other" holds the
    peak so far (model load)."""

    def __init__(self, trainer: Trainer) -> None:
        self.peaks: dict[str, float] = {}
        self.stage = "other"
        for (part, name), stage in STAGES.items():
            owner = trainer if part is None else getattr(trainer, part)
            setattr(owner, name, self._within(getattr(owner, name), stage))

    @staticmethod
    def available() -> bool:
        """Whether this kernel lets a process read and reset its high-water mark (Linux 4.0+)."""
        return os.access("/proc/self/clear_refs", os.W_OK)

    def _within(self, fn: Any, stage: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            outer = self._switch(stage)
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch(outer)

        return wrapped

    def _switch(self, stage: str) -> str:
        """Close the current stage's peak, reset the mark, enter ``stage``; the stage left."""
        self._record()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        outer, self.stage = self.stage, stage
        return outer

    def _record(self) -> None:
        with open("/proc/self/status") as status:
            line = next(row for row in status if row.startswith("VmHWM:"))
        mb = int(line.split()[1]) / 1024
        self.peaks[self.stage] = max(self.peaks.get(self.stage, 0.0), mb)

    @property
    def peak_mb(self) -> float:
        return max(self.peaks.values())

    def stop(self) -> dict[str, float]:
        self._record()
        return {k: round(v, 1) for k, v in self.peaks.items()}


def module_mb(model: torch.nn.Module | None) -> float:
    if model is None:
        return 0.0
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


def run(config: Config, warmup_peak_s: float = 1.0) -> dict[str, Any]:
    """Build a trainer, time ``config.train.steps`` steps; everything the JSON holds."""
    # `auto` decided here as the trainer decides it: the MFU peak is the chosen precision's
    build.prepare_process(config)
    config = build.concrete_precision(
        config, resolve_model_path(config.model.name), torch.device("cpu")
    )
    bf16 = config.model.autocast or config.model.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32  # the MFU peak is the compute precision's
    peak_before = common.matmul_peak_flops(seconds=warmup_peak_s, dtype=dtype)
    t_load = time.perf_counter()
    trainer = Trainer(config)
    load_s = time.perf_counter() - t_load
    clock = StepClock(trainer)
    memory = StageMemory(trainer) if StageMemory.available() else None
    steps = []
    while trainer.state.step < config.train.steps:
        trainer.state.step += 1
        clock.reset()
        t0 = time.perf_counter()
        metrics = trainer.train_step()
        step_s = time.perf_counter() - t0
        rollout = clock.scored.rollout
        completion_tokens = int(rollout.completion_mask.sum())
        steps.append(
            {
                "step": trainer.state.step,
                "step_s": step_s,
                "rollout_s": metrics["time/rollout_s"],
                "reward_s": metrics["time/reward_s"],
                "logprobs_s": clock.frozen_s,
                "update_s": metrics["time/train_s"] - clock.frozen_s,
                "generated_tokens": completion_tokens,
                "trained_tokens": completion_tokens + int(rollout.prompt_mask.sum()),
                "update_positions": clock.positions,
                "update_logits": clock.logits,
                "reward": metrics["reward/mean"],
                "kl": metrics.get("kl", 0.0),
                # |trainer - sampler| log-prob of the sampled tokens (precision shows here)
                "logp_mismatch_mean": metrics.get("tis/mismatch_mean"),
                "logp_mismatch_max": metrics.get("tis/mismatch_max"),
                "completion_len": metrics["completion_len/mean"],
            }
        )
    # stopped with the steps: the peak measurement below is not a stage of a step
    stages = {"peak_rss_by_stage_mb": memory.stop()} if memory is not None else {}
    peak_after = common.matmul_peak_flops(seconds=warmup_peak_s, dtype=dtype)
    trainer.producer.rewards.close()
    summary = summarize(steps, trainer, peak_before, peak_after, load_s)
    if memory is not None:  # its resets also reset the process's own high-water mark
        summary["peak_rss_mb"] = memory.peak_mb
    return {"precision": str(dtype).removeprefix("torch."), **summary, **stages}


def summarize(
    steps: list[dict[str, Any]],
    trainer: Trainer,
    peak_before: float,
    peak_after: float,
    load_s: float,
) -> dict[str, Any]:
    params = common.matmul_params(trainer.state.policy)
    peak = (peak_before + peak_after) / 2
    total = {k: sum(s[k] for s in steps) for k in steps[0] if k != "step"}
    reference = trainer.state.reference.copy if trainer.state.reference is not None else None
    return {
        "engine": "grpo",
        "params": params,
        "threads": torch.get_num_threads(),
        "load_s": load_s,
        "matmul_peak_gflops": {"before": peak_before / 1e9, "after": peak_after / 1e9},
        "median_step_s": common.median([s["step_s"] for s in steps]),
        "median_split_s": {
            k: common.median([s[k] for s in steps])
            for k in ("rollout_s", "reward_s", "logprobs_s", "update_s")
        },
        "generated_tokens_per_s": total["generated_tokens"] / total["rollout_s"],
        "trained_tokens_per_s": total["trained_tokens"] / total["update_s"],
        "mfu_rollout": common.mfu(
            common.rollout_flops_per_token(params),
            total["generated_tokens"],
            total["rollout_s"],
            peak,
        ),
        "mfu_update": common.mfu(
            common.update_flops(
                params,
                common.head_params(trainer.state.policy),
                total["update_positions"],
                total["update_logits"],
            ),
            tokens=1,  # the FLOPs are the whole update's
            seconds=total["update_s"],
            peak_flops=peak,
        ),
        "reference_mb": module_mb(reference),
        "peak_rss_mb": common.peak_rss_mb(),
        "rewards": [s["reward"] for s in steps],
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="tiny")
    parser.add_argument("--steps", type=int, help="steps to time (default: the set-up's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON file to write (default: stdout only)")
    parser.add_argument(
        "--precision", choices=["float32", "bfloat16"], help="default: the set-up's"
    )
    parser.add_argument("overrides", nargs="*", help="dotted grpo config overrides key=value")
    args = parser.parse_args(argv)
    setup = common.with_precision(common.SETUPS[args.setup], args.precision)
    with tempfile.TemporaryDirectory() as tmp:
        tree = config_tree(setup, args.steps or setup["steps"], args.seed, tmp)
        config = build_config(merge_trees(tree, parse_overrides(args.overrides)))
        result = {"setup": args.setup, "overrides": args.overrides, **run(config)}
    result["grpo_source"] = str(Path(grpo.__file__).resolve().parent)  # which code ran
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    summary = {k: v for k, v in result.items() if k not in ("steps", "rewards")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
