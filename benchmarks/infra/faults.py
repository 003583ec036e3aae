"""The fault matrix of docs/checkpoints.md, measured: every cell's test (a fault injected across
a process boundary: the producer process, ``grpo serve``, reward workers, the sandboxed Python
tool) run by pytest, each recording the seconds from the fault to the stop (or to the failed
call) and the line said (``tests/faults.py``); the slow cells included.

    python -m benchmarks.infra.faults [--rounds 1]

JSON to benchmarks/results/faults.json: per cell the seconds of each round and the line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "faults.json"
CELLS = [  # the tests that record a cell
    "tests/training/test_producer_process.py::"
    "test_a_lost_producer_stops_the_run_with_a_checkpoint_and_the_same_command_resumes",
    "tests/rollout/test_server.py::"
    "test_a_lost_server_stops_the_run_with_a_checkpoint_and_the_same_command_resumes",
    "tests/rewards/test_reward_runner.py::"
    "test_a_worker_killed_stopped_or_answering_garbage_fails_its_call_in_one_line",
    "tests/rollout/test_python_tool.py::test_a_killed_or_stopped_program_is_an_error_for_the_model",
    "tests/rollout/test_python_tool.py::test_garbage_output_reaches_the_model_as_text",
    "tests/rollout/test_python_tool.py::test_a_killed_or_stopped_fork_server_is_replaced",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = defaultdict(list)
    lines: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder:
        times = Path(folder) / "faults.jsonl"
        env = {**os.environ, "GRPO_FAULT_TIMES": str(times)}
        for _ in range(args.rounds):
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            done = subprocess.run([*command, "-m", "slow or not slow", *CELLS], env=env, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"a cell's test failed (exit {done.returncode}): nothing written")
        for row in map(json.loads, times.read_text().splitlines()):
            seconds[row["cell"]].append(row["seconds"])
            lines[row["cell"]] = row["line"]
    report = {
        "machine": machine(),
        "rounds": args.rounds,
        "cells": {cell: {"seconds": seconds[cell], "line": lines[cell]} for cell in seconds},
    }
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
