"""Do two source trees compute the same run? Trains the same seeded runs from each tree's ``src``
and compares every metric of every step except wall-clock times.

    python -m benchmarks.infra.same_metrics BASE_TREE [NEW_TREE] --out /tmp/same

BASE_TREE is a checkout (``git worktree add /tmp/base REV``); NEW_TREE defaults to this one.
Runs: the tiny model, 4 steps, with a reward it moves from step 1 and evals every 2 steps; the
default recipe, 2 steps (held-out evals at steps 0 and 2). Prints one line per run and writes
JSON to ``--out``/same_metrics.json; exits 1 when any value differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# timings differ on every run; every other value must not
TIMED = ("time/", "tokens_per_s")


def float32(tree: Path) -> str:
    """Float32 in either tree: model.precision where the schema has it (the default recipe's
    auto decides by a timing), model.autocast before it."""
    schema = (tree / "src" / "grpo" / "config" / "schema.py").read_text()
    return "model.precision=float32" if "precision:" in schema else "model.autocast=false"


def runs(tree: Path) -> dict[str, list[str]]:
    toy = tree / "tests" / "toy_rewards.py"
    return {
        "tiny": [
            "recipes/smoke.yaml",
            "train.steps=4",
            "optim.lr=1e-3",
            f"rewards.functions=[{{name: {toy}:lowercase_share}}, {{name: format}}]",
            "train.eval_every=2",
            "train.eval_examples=8",
        ],
        # float32 in both trees: the recipe's `model.precision: auto` decides by a timing, which
        # two runs on a busy machine may read differently (`model.autocast` is read by trees
        # from before `model.precision` too)
        "default": ["train.steps=2", float32(tree)],
    }


def train(tree: Path, out: Path, name: str, args: list[str]) -> list[dict[str, Any]]:
    run = ["train.progress=false", "train.resume=never", f"train.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    command = [sys.executable, "-m", "grpo.cli", "train", *args, *run, f"train.run_name={name}"]
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(one line per value that differs, NaN equalling NaN; the keys only the second run logs),
    timings left out. A key only the first run logs is a difference: a metric was lost."""
    if len(a) != len(b):
        return [f"{len(a)} rows against {len(b)}"], []
    out, added = [], set()
    for row_a, row_b in zip(a, b, strict=True):
        for key in sorted(row_a.keys() | row_b.keys()):
            if key.startswith(TIMED):
                continue
            if key not in row_a:
                added.add(key)
                continue
            x, y = row_a[key], row_b.get(key)
            both_nan = (
                isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
            )
            if x != y and not both_nan:
                out.append(f"step {row_a.get('step')} {key}: {x} != {y}")
    return out, sorted(added)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path, nargs="?", default=ROOT)
    parser.add_argument("--out", type=Path, default=Path("/tmp/same_metrics"))
    args = parser.parse_args()
    result = {}
    for name, overrides in runs(args.new).items():
        a = train(args.base, args.out / "base", name, runs(args.base)[name])
        b = train(args.new, args.out / "new", name, overrides)
        diff, added = differences(a, b)
        values = sum(len([k for k in r if not k.startswith(TIMED)]) for r in a)
        result[name] = {"rows": len(a), "values": values, "differ": diff, "added": added}
        print(f"{name}: {len(a)} rows, {values} values, {len(diff)} differ", *diff, sep="\n  ")
        if added:
            print(f"  new metrics (not compared): {', '.join(added)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "same_metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r["differ"] for r in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
