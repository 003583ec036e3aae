"""Whole training steps with the HF engine against vLLM (its CPU build) on SmolLM2.

Runs ``benchmarks.speed.step`` in the default recipe's shape (4 prompts x G=8, 48 new tokens, one
micro-batch of 16 rows, no gradient checkpointing, beta 0) once per engine per round, alternated
HF, vLLM, HF, vLLM, ... so that other jobs on the machine slow both alike. A step's time covers
the rollout, rewards, log-probs, the update and, for vLLM, the weight push after it. Writes
benchmarks/results/engines_<setup>.json: per engine the median step time, its split, load time
and peak RSS, and the ratios vLLM / HF.

    .venv/bin/python -m benchmarks.speed.engines --rounds 2 --steps 6   # needs `make vllm`
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
DEFAULT_SHAPE = [
    "rollout.max_new_tokens=48",
    "optim.micro_batch_size=16",
    "model.gradient_checkpointing=false",
    "algorithm.beta=0",
    "optim.lr=5e-6",
]
ENGINES = ("hf", "vllm")


def run_one(setup: str, engine: str, steps: int, seed: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.speed.step", "--setup", setup, "--steps", str(steps)]
    cmd += ["--seed", str(seed), "--out", str(out), *DEFAULT_SHAPE, f"rollout.engine={engine}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per engine: medians over every timed step of every round; then vLLM / HF ratios."""
    per_engine = {}
    for engine, results in runs.items():
        steps = [s for r in results for s in r["steps"]]
        per_engine[engine] = {
            "median_step_s": common.median([s["step_s"] for s in steps]),
            "median_split_s": {
                k: common.median([s[k] for s in steps])
                for k in ("rollout_s", "reward_s", "logprobs_s", "update_s")
            },
            "load_s": [r["load_s"] for r in results],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "rewards": [r["rewards"] for r in results],
        }
    hf, vllm = per_engine["hf"], per_engine["vllm"]
    return {
        **per_engine,
        "step_ratio_vllm_over_hf": vllm["median_step_s"] / hf["median_step_s"],
        "rollout_ratio_vllm_over_hf": vllm["median_split_s"]["rollout_s"]
        / hf["median_split_s"]["rollout_s"],
        "peak_rss_ratio_vllm_over_hf": vllm["peak_rss_mb"] / hf["peak_rss_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, help="default: results/engines_<setup>.json")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in ENGINES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for engine in ENGINES:
                result = run_one(
                    args.setup, engine, args.steps, r, Path(tmp) / f"{engine}-{r}.json"
                )
                runs[engine].append(result)
                print(engine, r, f"median step {result['median_step_s']:.2f} s", flush=True)
    report = {
        "command": "python -m benchmarks.speed.engines " + " ".join(sys.argv[1:]),
        "shape": DEFAULT_SHAPE,
        "steps": args.steps,
        "rounds": args.rounds,
        **summary(runs),
    }
    out = args.out or RESULTS / f"engines_{args.setup}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if "ratio" in k}, indent=1))


if __name__ == "__main__":
    main()
