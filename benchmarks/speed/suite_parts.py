"""Parts of the test suite timed in two source trees side by side: pytest's collection of the
whole suite, and chosen test modules, each run alone in a fresh pytest, the trees alternated
round by round (so a busy machine slows both alike).

    python -m benchmarks.speed.suite_parts --base BASE_TREE [--rounds 2] [--out FILE] [MODULE ...]

The part ``suite`` is the whole suite as ``make test`` runs it (``-n auto --dist loadscope``).

BASE_TREE is a checkout (``git worktree add /tmp/base REV``); the tree measured is this one. A
module missing from a tree is left out there. Per part and tree: the wall time and the CPU time
(user + sys of pytest and the processes it waited for), medians over the rounds; written as
JSON (default ``benchmarks/results/suite_parts.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.speed.startup import cpu_name

ROOT = Path(__file__).resolve().parents[2]
COLLECT = "collection"  # the part that is the whole suite's collection
SUITE = "suite"  # the part that is the whole suite, run as make test runs it
ARGS = {COLLECT: ["--collect-only"], SUITE: ["-n", "auto", "--dist", "loadscope"]}
WHOLE = set(ARGS)  # parts that are in every tree


def cpu_of_children() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def time_once(tree: Path, part: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh pytest over ``part`` in ``tree``."""
    args = ARGS.get(part, [part])
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cpu, t0 = cpu_of_children(), time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, cpu_of_children() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{part} in {tree} failed: {done.stdout.strip()[-500:]}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="test modules, relative to the trees")
    parser.add_argument("--base", type=Path, required=True, help="the tree measured against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/suite_parts.json")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "this": ROOT}
    parts = [COLLECT, *args.modules]
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {t: {} for t in trees}
    for _ in range(args.rounds):
        for part in parts:
            for label, tree in trees.items():
                if part in WHOLE or (tree / part).is_file():
                    runs[label].setdefault(part, []).append(time_once(tree, part))
    result: dict[str, Any] = {"cpu": cpu_name(), "rounds": args.rounds, "parts": {}}
    for part in parts:
        row: dict[str, Any] = {}
        for label in trees:
            if part in runs[label]:
                walls, cpus = zip(*runs[label][part], strict=True)
                row[label] = {
                    "wall_s": statistics.median(walls),
                    "cpu_s": statistics.median(cpus),
                    "walls": walls,
                    "cpus": cpus,
                }
        if len(row) == 2:
            row["this_over_base"] = {
                key: row["this"][key] / row["base"][key] for key in ("wall_s", "cpu_s")
            }
        result["parts"][part] = row
        said = "  ".join(
            f"{k} {v['wall_s']:.1f} s ({v['cpu_s']:.1f} CPU)" for k, v in row.items() if k in trees
        )
        print(f"{part}: {said}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"cpu: {result['cpu']}; written {args.out}")


if __name__ == "__main__":
    main()
