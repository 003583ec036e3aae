"""The seed's memory claim: PPO's critic against GRPO's group baseline, whole training steps.

Runs ``grpo train`` on the default recipe (SmolLM2-135M-Instruct, 4 prompts x G=8, 48 new
tokens; no evaluation, no checkpoints) with ``algorithm.estimator`` grpo and ppo, ``--steps``
steps per run, alternated grpo, ppo, grpo, ... over ``--rounds`` rounds so that other jobs on
the machine slow both alike. Each run is a fresh process; its peak RSS is read from
``getrusage`` of a wrapper that runs nothing else. Per estimator: the median step time
(``time/step_s``, every step but the first) with its split, and the largest peak RSS; then the
ratios PPO / GRPO.

    .venv/bin/python -m benchmarks.speed.ppo_vs_grpo --rounds 2 --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run_one(estimator: str, steps: int, out: Path, name: str) -> dict[str, Any]:
    train = ["train", "recipes/default.yaml", f"train.steps={steps}"]
    train += [f"train.output_dir={out}", f"train.run_name={name}"]
    return common.timed_run(
        out / name, [*train, f"algorithm.estimator={estimator}", *common.TIMED_RUN]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "ppo_vs_grpo_default_recipe.json")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"grpo": [], "ppo": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for estimator in runs:
                runs[estimator].append(
                    run_one(estimator, args.steps, Path(tmp), f"{estimator}-{r}")
                )
    grpo, ppo = common.run_summary(runs["grpo"]), common.run_summary(runs["ppo"])
    report = {
        "machine": common.machine(),
        "command": " ".join(["python -m benchmarks.speed.ppo_vs_grpo", *sys.argv[1:]]),
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "grpo": grpo,
        "ppo": ppo,
        "ppo_over_grpo": {
            "step": ppo["median_step_s"] / grpo["median_step_s"],
            "train": ppo["median_train_s"] / grpo["median_train_s"],
            "peak_rss": ppo["peak_rss_mb"] / grpo["peak_rss_mb"],
        },
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
