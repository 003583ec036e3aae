"""How long grpo takes to start: ``import grpo``, ``grpo --help`` and ``grpo config``, in fresh
interpreters, for one source tree or two side by side (alternated, so a busy machine slows both).

    python -m benchmarks.speed.startup [--base BASE_TREE] [--rounds 5] [--out FILE]

BASE_TREE is a checkout (``git worktree add /tmp/base REV``); the tree measured is this one.
Each command also reports whether torch or transformers was imported. Prints one line per
command and tree; writes JSON (default ``benchmarks/results/startup.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# each command runs inside a wrapper that prints which heavy modules it imported
WRAP = (
    "import sys, runpy\n"
    "sys.argv = {argv!r}\n"
    "try:\n"
    "    {body}\n"
    "except SystemExit:\n"
    "    pass\n"
    "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
    "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
)
COMMANDS: dict[str, tuple[list[str], str]] = {
    "import grpo": (["python"], "import grpo"),
    "grpo --help": (["grpo", "--help"], "runpy.run_module('grpo.cli', run_name='__main__')"),
    "grpo config": (["grpo", "config"], "runpy.run_module('grpo.cli', run_name='__main__')"),
}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{fields.get('Model name', '?').strip()} ({' '.join(wanted)})"


def time_once(tree: Path, name: str) -> tuple[float, list[str]]:
    argv, body = COMMANDS[name]
    code = WRAP.format(argv=argv, body=body)
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    heavy = [line for line in done.stderr.splitlines() if line.startswith("HEAVY=")]
    if not heavy:
        raise SystemExit(f"{name} in {tree} failed: {done.stderr.strip()[-300:]}")
    return seconds, [m for m in heavy[-1].removeprefix("HEAVY=").split(",") if m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="a second source tree, measured alternately")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/startup.json")
    args = parser.parse_args()
    trees = {"this": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    times: dict[str, dict[str, list[float]]] = {t: {c: [] for c in COMMANDS} for t in trees}
    heavy: dict[str, dict[str, list[str]]] = {t: {} for t in trees}
    for _ in range(args.rounds):
        for command in COMMANDS:
            for label, tree in trees.items():
                seconds, modules = time_once(tree, command)
                times[label][command].append(seconds)
                heavy[label][command] = modules
    result: dict[str, Any] = {"cpu": cpu_name(), "rounds": args.rounds, "trees": {}}
    for label, tree in trees.items():
        rows = {}
        for command, values in times[label].items():
            rows[command] = {
                "median_s": statistics.median(values),
                "seconds": values,
                "imports": heavy[label][command],
            }
            print(
                f"{label:5} {command:12} median {statistics.median(values):.2f} s "
                f"(min {min(values):.2f}); imports {heavy[label][command] or 'neither'}"
            )
        result["trees"][label] = {"path": str(tree), "commands": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"cpu: {result['cpu']}; written {args.out}")


if __name__ == "__main__":
    main()
