"""Zero-variance groups before and after prompt curation, read from a `grpo curate` summary
and short runs of the same recipe (on the original prompts, then on kept ones).

    python -m benchmarks.quality.curation CURATE_JSON RUN_BEFORE RUN_AFTER [RUN_AFTER ...] [--output F]

Per run: ``frac_zero_std`` and ``reward/mean`` at each step and their means over the steps
(the share of groups whose rewards were all equal, which carry no gradient), and the median
step time. The JSON goes to benchmarks/results/curation_default.json unless --output says
otherwise (docs/evaluation.md, "Prompt curation").
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import yaml

RESULTS = Path(__file__).resolve().parents[1] / "results" / "curation_default.json"


def run_summary(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "frac_zero_std" in r]
    zero = [r["frac_zero_std"] for r in steps]
    reward = [r["reward/mean"] for r in steps]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    data = config["data"]
    return {
        "run": str(run_dir),
        "data": {k: data[k] for k in ("task", "task_args", "path", "few_shot")},
        "rewards": config["rewards"]["functions"],
        "steps": len(steps),
        "frac_zero_std_by_step": zero,
        "frac_zero_std_mean": sum(zero) / len(zero),
        "reward_by_step": reward,
        "reward_mean": sum(reward) / len(reward),
        "step_s_median": statistics.median(
            r["time/rollout_s"] + r["time/reward_s"] + r["time/train_s"] for r in steps
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curate_json", type=Path)
    parser.add_argument("runs", nargs="+", type=Path, help="the run on the original prompts first")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = {
        "curate": json.loads(args.curate_json.read_text())["summary"],
        "runs": [run_summary(run) for run in args.runs],
    }
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
