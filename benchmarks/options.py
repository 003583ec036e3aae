"""grpo against itself: one set-up under different config overrides, runs alternated.

    .venv/bin/python -m benchmarks.options --setup smollm2 --steps 4 \\
        --variant default= \\
        --variant malloc_return=train.malloc=return \\
        --variant no_checkpointing=model.gradient_checkpointing=false

Each variant is ``name=override,override,...`` (dotted grpo overrides, none for the set-up as it
is). Rounds run every variant once, in order (A B C A B C ...), each in its own process so peak
RSS is its own; round r uses seed r. The JSON has every run and, per variant, the median step
time over all its steps, its highest peak RSS and both as ratios to the first variant.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common

RESULTS = Path(__file__).parent / "results"


def run_variant(setup: str, steps: int, seed: int, overrides: list[str], out: Path) -> dict:
    cmd = ["-m", "benchmarks.step", "--setup", setup, "--steps", str(steps), "--seed", str(seed)]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    subprocess.run(
        [sys.executable, *cmd, "--out", str(out), *overrides],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())


def summarize(variants: dict[str, list[str]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, overrides in variants.items():
        mine = [r for r in runs if r["variant"] == name]
        out[name] = {
            "overrides": overrides,
            "median_step_s": common.median([s["step_s"] for r in mine for s in r["steps"]]),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
            "mean_completion_len": common.median(
                [s["completion_len"] for r in mine for s in r["steps"]]
            ),
        }
    first = out[next(iter(variants))]
    for stats in out.values():
        stats["step_time_ratio"] = common.ratio(stats["median_step_s"], first["median_step_s"])
        stats["peak_rss_ratio"] = common.ratio(stats["peak_rss_mb"], first["peak_rss_mb"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="tiny")
    parser.add_argument("--steps", type=int, help="steps per run (default: the set-up's)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variant", action="append", required=True, help="name=k=v,k=v")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    variants = {}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        variants[name] = [o for o in overrides.split(",") if o]
    steps = args.steps or common.SETUPS[args.setup]["steps"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, overrides in variants.items():
                result = run_variant(
                    args.setup, steps, r, overrides, Path(tmp) / f"{name}-{r}.json"
                )
                print(
                    f"round {r} {name}: median step {result['median_step_s']:.3f} s, "
                    f"peak RSS {result['peak_rss_mb']:.0f} MiB",
                    flush=True,
                )
                runs.append({"variant": name, "round": r, **result})
    summary = {"setup": args.setup, "steps": steps, "rounds": args.rounds}
    summary["variants"] = summarize(variants, runs)
    out = args.out or RESULTS / f"options_{args.setup}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
