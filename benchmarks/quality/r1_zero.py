"""R1-Zero runs side by side, from their run directories: the held-out accuracy and format rate
before and after, the per-step rewards, the signals of reward hacking, the reflection rate,
completions at the first and last step, and the wall time. The numbers behind
README, "R1-Zero on a base model", and docs/results/r1-zero.md (each lever a run).

    .venv/bin/python -m benchmarks.quality.r1_zero runs runs/r1/a runs/r1/b [--out F]

The JSON goes to benchmarks/results/r1_zero.json unless --out says otherwise.

And the base model's own addition, apart from the format: the share of held-out problems for
which its greedy continuation of the rendered prompt followed by `` a + b =`` starts with the
sum (what an answer could copy from the reasoning, if the model wrote it there):

    .venv/bin/python -m benchmarks.quality.r1_zero addition --examples 100 [overrides]

Wall time: from the run's start (its ``config_history.jsonl``, written once the model is loaded)
to the last write of its ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path
from typing import Any

import yaml

from benchmarks import common

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "r1-zero-sums.yaml"
NUMBER_RE = re.compile(r"\d+")

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


def per_step_keys(rows: list[dict[str, Any]]) -> list[str]:
    """``PER_STEP``, and the mean of every reward function the run has (the accuracy reward
    of a task may have another name: ``reasoning_gym``)."""
    means = sorted({k for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean")})
    return list(dict.fromkeys([*means, *PER_STEP]))


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
        "per_step": {
            k: [round(r[k], 4) for r in ordered if k in r] for k in per_step_keys(ordered)
        },
        "eval": {
            r["step"]: {k: r[k] for k in EVAL if k in r} for r in rows if "eval/accuracy" in r
        },
        "median_step_s": common.median([r["time/step_s"] for r in ordered]),
        "wall_s": round(wall_seconds(run_dir), 1),
        "completions": {1: completions(run_dir, 1), last: completions(run_dir, last)},
    }


def addition_rate(overrides: list[str], examples: int) -> float:
    """Share of held-out "What is a + b?" rows whose greedy continuation of the prompt and
    `` a + b =`` starts with the sum."""
    import torch

    from grpo import build
    from grpo.config import load_config
    from grpo.data import heldout_rows

    config = load_config(RECIPE, overrides)
    rows = list(heldout_rows(config.data, config.train.seed, examples))
    parts = build.build_for_sampling(config, rows)
    right = 0
    try:
        for row in rows:
            a, b = NUMBER_RE.findall(row["prompt"])[:2]
            text = parts.prompt_format.render(parts.tokenizer, row) + f" {a} + {b} ="
            ids = parts.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = parts.policy.generate(ids, max_new_tokens=4, do_sample=False)
            said = NUMBER_RE.findall(parts.tokenizer.decode(out[0, ids.shape[1] :]))
            right += bool(said) and said[0] == str(row["answer"])
    finally:
        parts.rewards.close()
    return right / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    runs_cmd = commands.add_parser("runs", help="summarise run directories, one per lever")
    runs_cmd.add_argument("runs", nargs="+", type=Path)
    runs_cmd.add_argument("--out", type=Path, default=RESULTS)
    add_cmd = commands.add_parser("addition", help="the base model's own addition")
    add_cmd.add_argument("--examples", type=int, default=100)
    add_cmd.add_argument(
        "overrides", nargs="*", help="dotted overrides of recipes/r1-zero-sums.yaml"
    )
    args = parser.parse_args()
    if args.command == "addition":
        rate = addition_rate(args.overrides, args.examples)
        print(json.dumps({"machine": common.machine(), "overrides": args.overrides, "rate": rate}))
        return
    runs = [summary(run) for run in args.runs]
    args.out.write_text(json.dumps({"machine": common.machine(), "runs": runs}, indent=1) + "\n")
    for run in runs:  # one line per lever; the whole in the JSON
        evals = " -> ".join(f"{e.get('eval/accuracy', 0):.3f}" for e in run["eval"].values())
        print(f"{run['run']}: {run['steps']} steps, {run['wall_s']:.0f} s, accuracy {evals or '-'}")


if __name__ == "__main__":
    main()
