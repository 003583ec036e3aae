"""Gemma 3 steps, packed against one padded row per completion.

Gemma 3's local layers attend within a sliding window (512 tokens for the 270M model). Scoring
used to give such models one padded row per completion, since the packed layout replaces the
model's masks; now a batch whose sequences all fit in the window is packed (a window that long
excludes nothing). This runs ``grpo train recipes/r1-zero.yaml`` (no evaluation, no
checkpoints) for ``--steps`` steps per run, alternated rows, packed, rows, ... over ``--rounds``
rounds; "rows" is the same code with the window check answering "does not fit". Each run is a
fresh process whose peak RSS is read with ``getrusage``. Per variant: the median step and update
time (every step but the first) and the largest peak RSS; then packed / rows.

    .venv/bin/python -m benchmarks.speed.windowed --rounds 2 --steps 4   # needs `make gemma`
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"
# "rows": the window check answers "does not fit" for every windowed model's batch
ROWS = (
    "import grpo.scoring.logprobs as logprobs; "
    "logprobs.fits_window = lambda model, *masks: logprobs.sliding_window(model) is None"
)
VARIANTS = {"rows": ROWS, "packed": ""}


def run_one(variant: str, steps: int, out: Path, name: str) -> dict[str, Any]:
    train = ["train", "recipes/r1-zero.yaml", f"train.steps={steps}"]
    train += [f"train.output_dir={out}", f"train.run_name={name}", *common.TIMED_RUN]
    return common.timed_run(out / name, train, VARIANTS[variant])


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
    rows, packed = common.run_summary(runs["rows"]), common.run_summary(runs["packed"])
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
