"""grpo against TRL's GRPOTrainer on the same model, data, rewards and hyper-parameters.

    .venv/bin/python -m benchmarks.speed.vs_trl --setup tiny --rounds 2
    .venv/bin/python -m benchmarks.speed.vs_trl --setup smollm2 --rounds 2 --steps 8
    .venv/bin/python -m benchmarks.speed.vs_trl --setup smollm2-fast --rounds 1   # both at their fastest

Runs alternate A B A B (TRL, grpo, TRL, grpo, ...), each in its own process so peak RSS is per
run, and round r uses seed r for both. Both trainers see the same prompts in the same order
(TRL's sampler is fed grpo's seeded prompt stream with shuffling off), the same chat template and
system prompt, the same reward functions, G, prompts per step, max new tokens, learning rate
(constant), AdamW betas, gradient clipping, beta, loss aggregation, micro-batch size and gradient
checkpointing (on: TRL's default; the ``-fast`` set-ups turn it off on both sides and train the
whole step as one micro-batch, each trainer's fastest settings here) and precision: in the
SmolLM2 set-ups bf16 autocast over float32 weights on both sides (TRL's ``bf16=True``, its
default; grpo's ``model.precision``) where this CPU's bf16 matrix product is clearly faster,
decided once per comparison by measuring both, else float32 (the tiny set-ups: float32).
Writes the per-run JSON and a summary: ratios of median step time and of peak RSS
(grpo / TRL), and both reward curves.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.speed.step import config_tree
from grpo.config import build_config
from grpo.runtime import host_memory as memory

RESULTS = Path(__file__).resolve().parents[1] / "results"


# ------------------------------------------------------------------------------------ TRL worker


def trl_dataset_rows(setup: dict[str, Any], steps: int, seed: int) -> list[dict[str, Any]]:
    """The rows grpo's prompt stream yields over ``steps`` steps, as TRL conversational prompts."""
    from grpo.data import load_dataset_rows, system_prompt_for
    from grpo.data.stream import PromptStream

    config = build_config(config_tree(setup, steps, seed, tempfile.gettempdir()))
    rows = load_dataset_rows(config.data, seed)
    system = system_prompt_for(config.data)
    stream = PromptStream(rows, seed, config.data.shuffle)
    taken = stream.take(steps * setup["prompts_per_step"])
    return [
        {
            "prompt": [
                {"role": "system", "content": system},
                {"role": "user", "content": row["prompt"]},
            ],
            "answer": row["answer"],
        }
        for row in taken
    ]


def _on_text(fn: Any) -> Any:
    """A grpo-style reward over strings, called with TRL's conversational completions."""

    def reward(completions: list[list[dict[str, str]]], **columns: Any) -> list[float]:
        return fn([c[-1]["content"] for c in completions], **columns)

    reward.__name__ = fn.__name__
    return reward


def run_trl(setup: dict[str, Any], steps: int, seed: int) -> dict[str, Any]:
    # TRL as a program without grpo runs it: oneDNN's kernel caches at their own size (a grpo
    # run started in this process would have capped them)
    memory.unbound_kernel_caches()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.models import load_tokenizer, resolve_model_path

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    dtype = common.DTYPES[setup["precision"]]
    peak_before = common.matmul_peak_flops(dtype=dtype)
    t_load = time.perf_counter()
    path = resolve_model_path(setup["model"])
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = setup["prompts_per_step"] * setup["group_size"]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=setup["micro_batch_size"],
            gradient_accumulation_steps=n // setup["micro_batch_size"],
            num_generations=setup["group_size"],
            max_completion_length=setup["max_new_tokens"],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=setup["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            adam_beta1=0.9,
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=1.0,
            gradient_checkpointing=setup["gradient_checkpointing"],
            beta=setup["beta"],
            loss_type=setup["loss_type"],
            scale_rewards="group",
            epsilon=0.2,
            num_iterations=1,
            max_steps=steps,
            seed=seed,
            shuffle_dataset=False,
            use_cpu=True,
            bf16=setup["precision"] == "bfloat16",
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            log_completions=False,
        )
        clock = Clock()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[_on_text(common.last_integer), _on_text(common.answer_tag)],
            args=args,
            train_dataset=Dataset.from_list(trl_dataset_rows(setup, steps, seed)),
            processing_class=tokenizer,
            callbacks=[clock],
        )
        load_s = time.perf_counter() - t_load
        trainer.train()
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    peak_after = common.matmul_peak_flops(dtype=dtype)
    return {
        "engine": "trl",
        "threads": torch.get_num_threads(),
        "load_s": load_s,
        "precision": setup["precision"],
        "matmul_peak_gflops": {"before": peak_before / 1e9, "after": peak_after / 1e9},
        "median_step_s": common.median(step_s),
        "peak_rss_mb": common.peak_rss_mb(),
        "rewards": [log["reward"] for log in clock.logs],
        "steps": [
            {
                "step": i + 1,
                "step_s": s,
                "reward": log["reward"],
                "kl": log.get("kl", 0.0),
                "completion_len": log.get("completions/mean_length", float("nan")),
            }
            for i, (s, log) in enumerate(zip(step_s, clock.logs, strict=False))
        ],
    }


# ------------------------------------------------------------------------------------ driver


def run_one(
    engine: str, setup: str, precision: str, steps: int, seed: int, out: Path
) -> dict[str, Any]:
    """One run in a fresh process (so its peak RSS is its own)."""
    if engine == "trl":
        cmd = ["-m", "benchmarks.speed.vs_trl", "--worker", "--setup", setup]
    else:
        cmd = ["-m", "benchmarks.speed.step", "--setup", setup]
    cmd += ["--precision", precision, "--steps", str(steps), "--seed", str(seed), "--out", str(out)]
    return common.run_child(cmd, out)


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios grpo / TRL of the median step time (over all steps of all runs) and of peak RSS."""
    by = {e: [r for r in runs if r["engine"] == e] for e in ("trl", "grpo")}
    step = {e: common.median([s["step_s"] for r in rs for s in r["steps"]]) for e, rs in by.items()}
    rss = {e: max(r["peak_rss_mb"] for r in rs) for e, rs in by.items()}
    curves = {
        e: [common.median(list(vals)) for vals in zip(*(r["rewards"] for r in rs), strict=False)]
        for e, rs in by.items()
    }
    mean_reward = {e: sum(c) / len(c) for e, c in curves.items()}
    return {
        "median_step_s": step,
        "step_time_ratio": common.ratio(step["grpo"], step["trl"]),
        "peak_rss_mb": rss,
        "peak_rss_ratio": common.ratio(rss["grpo"], rss["trl"]),
        "reward_curve": curves,
        "mean_reward": mean_reward,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="tiny")
    parser.add_argument("--steps", type=int, help="steps per run (default: the set-up's)")
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs to alternate")
    parser.add_argument("--seed", type=int, default=0, help="worker only")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    parser.add_argument(
        "--precision", choices=["float32", "bfloat16"], help="default: the set-up's"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # decided once here, so both trainers run in the same precision
    setup = common.with_precision(common.SETUPS[args.setup], args.precision)
    steps = args.steps or setup["steps"]
    if args.worker:
        result = {"setup": args.setup, **run_trl(setup, steps, args.seed)}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for engine in ("trl", "grpo"):
                out = Path(tmp) / f"{engine}-{r}.json"
                result = run_one(engine, args.setup, setup["precision"], steps, r, out)
                print(
                    f"round {r} {engine:4s}: median step {result['median_step_s']:.3f} s, "
                    f"peak RSS {result['peak_rss_mb']:.0f} MiB, "
                    f"mean reward {sum(result['rewards']) / len(result['rewards']):.3f}",
                    flush=True,
                )
                runs.append({"round": r, **result})
    summary = {
        "setup": args.setup,
        "machine": common.machine(),  # one docs row per machine kind (docs/results/vs-trl.md)
        "precision": setup["precision"],
        "steps": steps,
        "rounds": args.rounds,
        **compare(runs),
    }
    out = args.out or RESULTS / f"vs_trl_{args.setup}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "reward_curve"}, indent=1))


if __name__ == "__main__":
    main()
