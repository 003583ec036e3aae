"""The with/without-tool table of docs/results/tools-multiplication.md, read from two finished runs of ``recipes/tools.yaml``.

    python -m benchmarks.quality.tools_table runs/tools-with runs/tools-without

Per run: reward by step (and its mean over each half of the run), held-out greedy accuracy at
every evaluation, the share of completions (training rollouts and held-out) that ran a tool call,
and the share of logged training completions whose answer is the tool's output verbatim. The
JSON goes to benchmarks/results/tools_multiplication.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "tools_multiplication.json"
ANSWER_RE = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def block_mean(values: list[float], start: int, stop: int) -> float:
    kept = [v for v in values[start:stop] if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def echo_share(run_dir: Path) -> float:
    """Share of logged training completions whose <answer> is the last tool output verbatim."""
    records = [
        json.loads(line)
        for path in sorted((run_dir / "completions").glob("step-*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    with_output = [r for r in records if any(t.get("output") for t in r.get("turns", []))]
    if not with_output:
        return math.nan
    echoed = 0
    for r in with_output:
        found = ANSWER_RE.findall(r["completion"])
        last = [t["output"].strip() for t in r["turns"] if t.get("output")][-1]
        echoed += bool(found) and found[-1].strip() == last
    return echoed / len(records)


def summarize(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    reward = [r["reward/mean"] for r in steps]
    calls = [r.get("tools/call_frac", math.nan) for r in steps]
    half = len(steps) // 2
    return {
        "run": str(run_dir),
        "steps": len(steps),
        "reward_by_step": reward,
        "reward_mean": block_mean(reward, 0, len(steps)),
        "reward_mean_first_half": block_mean(reward, 0, half),
        "reward_mean_second_half": block_mean(reward, half, len(steps)),
        "eval_accuracy_by_step": {str(r["step"]): r["eval/accuracy"] for r in evals},
        "eval_examples": evals[0]["eval/examples"] if evals else 0,
        "call_frac_by_step": calls,
        "call_frac_first_half": block_mean(calls, 0, half),
        "call_frac_second_half": block_mean(calls, half, len(steps)),
        "error_rate_by_step": [r.get("tools/error_rate", math.nan) for r in steps],
        "frac_zero_std_by_step": [r["frac_zero_std"] for r in steps],
        "call_frac_eval_by_step": {
            str(r["step"]): r.get("eval/tools/call_frac", math.nan) for r in evals
        },
        "answer_is_tool_output_share": echo_share(run_dir),
        "completion_len_by_step": [r["completion_len/mean"] for r in steps],
        "step_time_s": sum(
            r[k] for r in steps for k in ("time/rollout_s", "time/reward_s", "time/train_s")
        ),
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
