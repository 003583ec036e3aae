"""Gemma 3 steps, packed against one padded row per completion.

Gemma 3's local layers attend within a sliding window (512 tokens for the 270M model). Scoring
used to give such models one padded row per completion, since the packed layout replaces the
model's masks; now a batch whose sequences all fit in the window is packed (a window that long
excludes nothing). This runs ``grpo train recipes/r1-zero-sums.yaml`` (no evaluation, no
checkpoints) for ``--steps`` steps per run, alternated rows, packed, rows, ... over ``--rounds``
rounds; "rows" is the same code with the window check answering "does not fit". Each run is a
fresh process whose peak RSS is read with ``getrusage``. Per variant: the median step and update
time (every step but the first) and the largest peak RSS; then packed / rows.

    .venv/bin/python -m benchmarks.speed.windowed --rounds 2 --steps 4   # needs `make gemma`
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"
# "rows": the window check answers "does not fit" for every windowed model's batch
ROWS = (
    "import grpo.scoring.logprobs as logprobs; "
    "logprobs.fits_window = lambda model, *masks: logprobs.sliding_window(model) is None"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "windowed_gemma3.json")
    args = parser.parse_args()
    recipe = ["recipes/r1-zero-sums.yaml"]
    variants = {"rows": (recipe, ROWS), "packed": (recipe, "")}
    common.compare_two("benchmarks.speed.windowed", variants, args.rounds, args.steps, args.out)


if __name__ == "__main__":
    main()
