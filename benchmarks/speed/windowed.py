"""Gemma 3 steps, packed against one padded row per completion.

Gemma 3's local layers attend within a sliding window (512 tokens for the 270M model). Scoring
used to give such models one padded row per completion, since the packed layout replaces the
model's masks; now a batch whose sequences all fit in the window is packed (a window that long
excludes nothing). This runs ``grpo train recipes/gemma-r1-zero.yaml`` (no evaluation, no
checkpoints) for ``--steps`` steps per run, alternated rows, packed, rows, ... over ``--rounds``
rounds; "rows" is the same code with the window check answering "does not fit". Each run is a
fresh process whose peak RSS is read with ``getrusage``. Per variant: the median step and update
time (every step but the first) and the largest peak RSS; then packed / rows.

    .venv/bin/python -m benchmarks.speed.windowed --rounds 2 --steps 4   # needs `make gemma`
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
# one training in a fresh interpreter; "rows" makes every batch outgrow the window; prints the
# peak RSS (KiB) of that interpreter
CHILD = """
import resource, sys
import grpo.scoring.logprobs as logprobs
if sys.argv[1] == "rows":
    logprobs.fits_window = lambda model, *masks: logprobs.sliding_window(model) is None
from grpo.cli import main
code = main(sys.argv[2:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""
VARIANTS = ("rows", "packed")


def run_one(variant: str, steps: int, out: Path, name: str) -> dict[str, Any]:
    train = ["train", "recipes/gemma-r1-zero.yaml", f"train.steps={steps}"]
    train += [f"train.output_dir={out}", f"train.run_name={name}", *common.TIMED_RUN]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, variant, *train], check=True, capture_output=True, text=True
    )
    return {
        "rows": common.timed_steps(out / name),
        "peak_rss_mb": int(done.stdout.split()[-1]) / 1024,
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for run in runs for r in run["rows"]]
    return {
        "steps_timed": len(rows),
        "median_step_s": common.median([r["time/step_s"] for r in rows]),
        "median_train_s": common.median([r["time/train_s"] for r in rows]),
        "median_completion_len": common.median([r["completion_len/mean"] for r in rows]),
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "windowed_gemma3.json")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for variant in VARIANTS:
                runs[variant].append(run_one(variant, args.steps, Path(tmp), f"{variant}-{r}"))
    rows, packed = summary(runs["rows"]), summary(runs["packed"])
    report = {
        "machine": common.machine(),
        "command": " ".join(["python -m benchmarks.speed.windowed", *sys.argv[1:]]),
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "rows": rows,
        "packed": packed,
        "packed_over_rows": {
            "step": packed["median_step_s"] / rows["median_step_s"],
            "train": packed["median_train_s"] / rows["median_train_s"],
            "peak_rss": packed["peak_rss_mb"] / rows["peak_rss_mb"],
        },
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
