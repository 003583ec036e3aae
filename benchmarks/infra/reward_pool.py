"""What running user rewards in worker processes costs: a step's reward phase through the runner
(one call per completion, sent to ``workers`` processes and checked) against calling the same
function in this process, alternated step by step in one run.

The function is trivial (the share of lowercase letters), so the figure is the runner's own
overhead per completion: pickling the completion and its columns, the pipe round trip, checks.

Run: ``.venv/bin/python -m benchmarks.infra.reward_pool [--completions 64] [--steps 20]``; writes
``benchmarks/results/reward_pool.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from grpo.config import RewardsConfig, RewardSpec
from grpo.rewards import RewardRunner

RESULTS = Path(__file__).resolve().parents[1] / "results" / "reward_pool.json"
FUNCTION = """
def lowercase_share(completions, **kw):
    return [sum(c.islower() for c in t) / max(len(t), 1) for t in completions]
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    n = args.completions
    completions = [f"<think>step {i}</think><answer>{i * 7}</answer>" * 8 for i in range(n)]
    columns = {"answer": [str(i * 7) for i in range(n)]}
    with tempfile.TemporaryDirectory() as folder:
        module = Path(folder) / "bench_rewards.py"
        module.write_text(FUNCTION)
        namespace: dict = {}
        exec(FUNCTION, namespace)  # the same function, in this process
        direct = namespace["lowercase_share"]
        runner = RewardRunner(
            RewardsConfig(
                functions=[RewardSpec(name=f"{module}:lowercase_share")], workers=args.workers
            )
        )
        pooled_s, direct_s = [], []
        try:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out = runner(completions, ["p"] * n, columns, [[1]] * n)
                t1 = time.perf_counter()
                pairs = zip(completions, columns["answer"], strict=True)
                expected = [direct([text], answer=[gold])[0] for text, gold in pairs]
                t2 = time.perf_counter()
                pooled_s.append(t1 - t0)
                direct_s.append(t2 - t1)
                got = out.per_function[:, 0].tolist()
                assert all(abs(a - b) < 1e-6 for a, b in zip(got, expected, strict=True))
        finally:
            runner.close()
    result = {
        "completions": n,
        "workers": args.workers,
        "steps": args.steps,
        "median_step_s_worker_processes": statistics.median(pooled_s),
        "median_step_s_in_process": statistics.median(direct_s),
        "median_ms_per_completion_worker_processes": 1000 * statistics.median(pooled_s) / n,
    }
    print(json.dumps(result, indent=1))
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
