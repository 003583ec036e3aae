"""Summaries of finished training runs, side by side, from their metrics.jsonl: means over windows
of 10 steps, held-out eval rows, median timings and the temperatures used. The numbers behind
the run tables of docs/results/ (default-recipe.md, vllm.md, temperature.md).

    .venv/bin/python -m benchmarks.quality.run_curves runs/a runs/b --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import common

WINDOWED = (
    "reward/mean",
    "reward/accuracy/mean",
    "frac_zero_std",
    "entropy",
    "completion_len/mean",
)
EVAL = ("eval/accuracy", "eval/answer_rate", "eval/completion_len")


def windows(values: list[float], size: int = 10) -> list[float]:
    return [
        sum(chunk) / len(chunk)
        for chunk in (values[i : i + size] for i in range(0, len(values), size))
    ]


def summary(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "reward/mean" in r}  # the last row of a step wins
    ordered = [steps[k] for k in sorted(steps)]
    step_s = [r["time/rollout_s"] + r["time/reward_s"] + r["time/train_s"] for r in ordered]
    return {
        "run": str(run_dir),
        "steps": len(ordered),
        "windows_of_10": {k: windows([r[k] for r in ordered if k in r]) for k in WINDOWED},
        "eval": {
            r["step"]: {k: r[k] for k in EVAL if k in r} for r in rows if "eval/accuracy" in r
        },
        "temperature": [r.get("rollout/temperature") for r in ordered],
        "median_rollout_s": common.median([r["time/rollout_s"] for r in ordered]),
        "median_step_s": common.median(step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = [summary(run) for run in args.runs]
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
