"""Generation ahead of training: the default recipe's steps at rollout.max_staleness 0 and 1.

Runs ``grpo train`` on the default recipe (no evaluation, no checkpoints, ``algorithm.tis_cap``
2 on both sides so that only k differs) for ``--steps`` steps per run, alternated k=0, k=1,
k=0, ... over ``--rounds`` rounds, so that other jobs on the machine slow both alike. At k = 1
the cores are split between trainer and producer (``rollout.producer_threads``, default half).

Per k, over every step but each run's first (the producer's start): the median step wall time
(``time/step_s``) and steps per minute; the median generation (rollout + rewards) and update
seconds; at k = 1 the shares of wall time the trainer and the producer were busy and the time
both were. The model: a synchronous step is G0 + U0 (generation and update on all cores); one
ahead is max(G1, U1) plus what neither overlaps, with G1, U1 measured on the split cores; the
JSON has the prediction beside the measurement.

    .venv/bin/python -m benchmarks.speed.ahead --rounds 2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"
SAME = [*common.TIMED_RUN, "algorithm.tis_cap=2.0"]


def run_one(k: int, steps: int, out: Path, name: str, extra: list[str]) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "grpo.cli", "train", "recipes/default.yaml"]
    cmd += [f"train.steps={steps}", f"train.output_dir={out}", f"train.run_name={name}"]
    cmd += [f"rollout.max_staleness={k}", *SAME, *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return common.timed_steps(out / name)


def per_k(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps given (each run's first step left out by the caller)."""
    med = common.median
    step = med([r["time/step_s"] for r in rows])
    gen = med([r["time/rollout_s"] + r["time/reward_s"] for r in rows])
    upd = med([r["time/train_s"] for r in rows])
    out = {
        "steps_timed": len(rows),
        "median_step_s": step,
        "steps_per_min": 60 / step,
        "median_generation_s": gen,
        "median_update_s": upd,
    }
    if "time/wait_rollout_s" in rows[0]:
        busy_trainer = med(
            [(r["time/step_s"] - r["time/wait_rollout_s"]) / r["time/step_s"] for r in rows]
        )
        busy_producer = med(
            [(r["time/rollout_s"] + r["time/reward_s"]) / r["time/step_s"] for r in rows]
        )
        out |= {
            "median_wait_rollout_s": med([r["time/wait_rollout_s"] for r in rows]),
            "median_wait_train_s": med([r["time/wait_train_s"] for r in rows]),
            "trainer_busy_share": busy_trainer,
            "producer_busy_share": min(busy_producer, 1.0),
            # both busy: what the two busy shares add beyond the whole (never negative)
            "both_busy_share": max(busy_trainer + min(busy_producer, 1.0) - 1.0, 0.0),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "ahead_default_recipe.json")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = parser.parse_args()
    runs: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k in (0, 1):
                runs[k] += run_one(k, args.steps, Path(tmp), f"k{k}-r{r}", args.overrides)
    sync, ahead = per_k(runs[0]), per_k(runs[1])
    # the model: a synchronous step is G0 + U0 on all cores; ahead, the stages overlap and the
    # slower one sets the pace: max(G1, U1) on the split cores
    predicted = max(ahead["median_generation_s"], ahead["median_update_s"])
    report = {
        "machine": common.machine(),
        "command": " ".join(["python -m benchmarks.speed.ahead", *sys.argv[1:]]),
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "k0": sync,
        "k1": ahead,
        "speedup_k1_over_k0": sync["median_step_s"] / ahead["median_step_s"],
        "model": {
            "sync_step_s_g0_plus_u0": sync["median_generation_s"] + sync["median_update_s"],
            "ahead_step_s_max_g1_u1": predicted,
            "predicted_speedup": sync["median_step_s"] / predicted,
        },
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
