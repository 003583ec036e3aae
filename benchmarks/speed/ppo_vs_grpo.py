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
from pathlib import Path

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "ppo_vs_grpo_default_recipe.json")
    args = parser.parse_args()
    variants = {
        name: (["recipes/default.yaml", f"algorithm.estimator={name}"], "")
        for name in ("grpo", "ppo")
    }
    common.compare_two("benchmarks.speed.ppo_vs_grpo", variants, args.rounds, args.steps, args.out)


if __name__ == "__main__":
    main()
