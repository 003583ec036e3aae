"""The README's with/without-tool table, read from two finished runs of ``recipes/tools.yaml``.

    python -m benchmarks.tools_table runs/tools-with runs/tools-without

Per run: mean reward over its steps, held-out greedy accuracy at step 0 and at the last step,
and the share of completions (training rollouts and held-out) that ran a tool call. The JSON
goes to benchmarks/results/tools_multiplication.json.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "tools_multiplication.json"


def summarize(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]

    def mean(key: str) -> float:
        values = [r[key] for r in steps if key in r and not math.isnan(r[key])]
        return sum(values) / len(values) if values else math.nan

    return {
        "run": str(run_dir),
        "steps": len(steps),
        "reward_by_step": [r["reward/mean"] for r in steps],
        "reward_mean": mean("reward/mean"),
        "eval_accuracy_first": evals[0]["eval/accuracy"] if evals else math.nan,
        "eval_accuracy_last": evals[-1]["eval/accuracy"] if evals else math.nan,
        "eval_examples": evals[0]["eval/examples"] if evals else 0,
        "eval_steps": [r["step"] for r in evals],
        "call_frac_by_step": [r.get("tools/call_frac", math.nan) for r in steps],
        "error_rate_by_step": [r.get("tools/error_rate", math.nan) for r in steps],
        "frac_zero_std_by_step": [r["frac_zero_std"] for r in steps],
        "call_frac_eval": [r.get("eval/tools/call_frac", math.nan) for r in evals],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    table = [summarize(run) for run in args.runs]
    RESULTS.write_text(json.dumps(table, indent=2) + "\n")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
