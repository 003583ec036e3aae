"""R1-Zero runs side by side, from their run directories: the held-out accuracy and format rate
before and after, the per-step rewards, the signals of reward hacking, the reflection rate,
completions at the first and last step, and the wall time. The numbers behind README's R1-Zero
table and docs/results/r1-zero.md (each lever a run).

    .venv/bin/python -m benchmarks.quality.r1_zero runs/r1/a runs/r1/b [--out F]

The JSON goes to benchmarks/results/r1_zero.json unless --out says otherwise.

Wall time: from the run's start (its ``config_history.jsonl``, written once the model is loaded)
to the last write of its ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import yaml

from benchmarks import common

PER_STEP = (
    "reward/accuracy/mean",
    "reward/format/mean",
    "frac_zero_std",
    "entropy",
    "completion_len/mean",
    "reflection_rate",
    "hack/template_copy",
    "hack/question_restated",
    "hack/format_only",
    "hack/length_collapse",
    "hack/entropy_collapse",
)
EVAL = ("eval/accuracy", "eval/answer_rate", "eval/reward/format/mean", "eval/completion_len")
SHOWN = 3  # completions shown per step
RESULTS = Path(__file__).resolve().parents[1] / "results" / "r1_zero.json"


def completions(run_dir: Path, step: int) -> list[dict[str, Any]]:
    path = run_dir / "completions" / f"step-{step:06d}.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()[:SHOWN]]
    return [{"completion": r["completion"], "rewards": r.get("rewards")} for r in rows]


def wall_seconds(run_dir: Path) -> float:
    start = json.loads((run_dir / "config_history.jsonl").read_text().splitlines()[0])["time"]
    begun = datetime.datetime.fromisoformat(start).replace(tzinfo=datetime.timezone.utc)
    return (run_dir / "metrics.jsonl").stat().st_mtime - begun.timestamp()


def summary(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "reward/mean" in r}
    ordered = [steps[k] for k in sorted(steps)]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    last = ordered[-1]["step"] if ordered else 0
    return {
        "run": run_dir.name,
        "rewards": config["rewards"]["functions"],
        "rollout": {
            k: config["rollout"][k]
            for k in ("prompts_per_step", "group_size", "temperature", "max_new_tokens")
        },
        "lr": config["optim"]["lr"],
        "task_args": config["data"]["task_args"],
        "steps": len(ordered),
        "per_step": {k: [round(r[k], 4) for r in ordered if k in r] for k in PER_STEP},
        "eval": {
            r["step"]: {k: r[k] for k in EVAL if k in r} for r in rows if "eval/accuracy" in r
        },
        "median_step_s": common.median([r["time/step_s"] for r in ordered]),
        "wall_s": round(wall_seconds(run_dir), 1),
        "completions": {1: completions(run_dir, 1), last: completions(run_dir, last)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, one per lever")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs = [summary(run) for run in args.runs]
    args.out.write_text(json.dumps({"machine": common.machine(), "runs": runs}, indent=1) + "\n")
    for run in runs:  # one line per lever; the whole in the JSON
        evals = " -> ".join(f"{e.get('eval/accuracy', 0):.3f}" for e in run["eval"].values())
        print(f"{run['run']}: {run['steps']} steps, {run['wall_s']:.0f} s, accuracy {evals or '-'}")


if __name__ == "__main__":
    main()
