"""Rollouts saved by the GRESO pre-rollout filter on a multi-epoch run of the arithmetic task.

Each scenario trains twice from the same seed and for the same number of steps (``epochs``
passes over a small arithmetic set without the filter), with the filter off and on, and counts
the completions generated, the completions saved (skipped prompts x G), the completions spent on
zero-variance groups (no gradient), and the time. Both runs generate P x G completions per step;
the filtered run spends fewer of them on groups that teach nothing.

- ``task-rewards``: the task's own rewards (format + accuracy). The tiny random model never earns
  them, so every group is zero-variance: the upper bound, where the filter skips
  ``greso_skip_prob`` of all visits after the first epoch at no cost in signal.
- ``digit-share``: the share of the answer's digits present in the completion, which random
  completions often earn in part: zero variance is rare and not a property of the prompt, so
  the filter has little to skip (and what it skips may have been informative at the next visit).

Run: ``.venv/bin/python benchmarks/quality/greso.py [--epochs 4] [--out benchmarks/results/greso.json]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from grpo.config import build_config
from grpo.training.trainer import Trainer


def digit_share(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """Share of the gold answer's distinct digits that occur in the completion."""
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        digits = set(str(gold).lstrip("-"))
        out.append(sum(d in completion for d in digits) / len(digits))
    return out


SCENARIOS: dict[str, list[dict[str, Any]]] = {
    "task-rewards": [{"name": "format"}, {"name": "accuracy"}],
    "digit-share": [{"name": f"{Path(__file__).resolve()}:digit_share"}],
}


def run(
    scenario: str, greso: bool, epochs: int, size: int, folder: Path, seed: int
) -> dict[str, Any]:
    prompts, group = 4, 8
    config = build_config(
        {
            "model": {"name": "tiny-random"},
            "data": {"task": "arithmetic", "task_args": {"size": size}},
            "rollout": {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": 16},
            "rewards": {"functions": SCENARIOS[scenario]},
            "algorithm": {"beta": 0.0},
            "sampling": {"greso": greso, "greso_history": 1, "greso_skip_prob": 0.75},
            "optim": {"lr": 1e-3, "micro_batch_size": 16},
            "train": {
                "steps": epochs * size // prompts,
                "seed": seed,
                "output_dir": str(folder),
                "run_name": f"{scenario}-{'greso' if greso else 'plain'}",
                "progress": False,
                "sinks": ["jsonl"],
                "log_completions": 0,
            },
        }
    )
    t0 = time.perf_counter()
    run_dir = Trainer(config).train()
    wall = time.perf_counter() - t0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = len(metrics)
    skipped = sum(m.get("greso/skipped", 0.0) for m in metrics)
    generated = steps * prompts * group
    return {
        "scenario": scenario,
        "greso": greso,
        "steps": steps,
        "completions_generated": generated,
        "completions_saved": skipped * group,
        "saved_share": skipped * group / (generated + skipped * group),
        "completions_in_zero_std_groups": sum(m["frac_zero_std"] for m in metrics)
        * prompts
        * group,
        "frac_zero_std_mean": sum(m["frac_zero_std"] for m in metrics) / steps,
        "reward_mean": sum(m["reward/mean"] for m in metrics) / steps,
        "rollout_s": sum(m["time/rollout_s"] for m in metrics),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--size", type=int, default=16, help="arithmetic problems (one epoch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/greso.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in SCENARIOS:
            for greso in (False, True):
                result = run(scenario, greso, args.epochs, args.size, Path(tmp), args.seed)
                print(json.dumps(result))
                results.append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"epochs": args.epochs, "size": args.size, "seed": args.seed, "model": "tiny-random"}
    args.out.write_text(json.dumps({"setup": setup, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
