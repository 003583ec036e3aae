"""grpo against itself: one set-up under different config overrides, runs alternated.

    .venv/bin/python -m benchmarks.speed.options --setup smollm2 --steps 4 \\
        --variant default= \\
        --variant malloc_return=train.malloc=return \\
        --variant no_checkpointing=model.gradient_checkpointing=false

Each variant is ``name=override,override,...`` (dotted grpo overrides, none for the set-up as it
is). ``name@revision=...`` runs grpo's code as it was at a git revision (from a worktree of it;
the benchmark's own code stays this tree's), so a change is timed against its parent side by
side in one run:

    .venv/bin/python -m benchmarks.speed.options --setup smollm2 --steps 4 --rounds 2 \
        --variant before@HEAD~1= --variant after=

Rounds run every variant once, in order (A B C A B C ...), each in its own process so peak
RSS is its own; round r uses seed r. The JSON has every run and, per variant, the median step
time over all its steps, its highest peak RSS and both as ratios to the first variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"


REPO = Path(__file__).resolve().parents[2]


def run_variant(
    setup: str, steps: int, seed: int, overrides: list[str], out: Path, src: Path | None = None
) -> dict:
    """One ``benchmarks.speed.step`` run in its own process; grpo imported from ``src`` if given."""
    cmd = ["-m", "benchmarks.speed.step", "--setup", setup, "--steps", str(steps)]
    cmd += ["--seed", str(seed)]
    result = common.run_child([*cmd, "--out", str(out), *overrides], out, src)
    if src is not None and not Path(result["grpo_source"]).is_relative_to(src.resolve()):
        raise SystemExit(f"grpo came from {result['grpo_source']}, not from {src}")
    return result


def parse_variant(spec: str) -> tuple[str, str | None, list[str]]:
    """``name[@revision]=override,...`` -> name, revision (None: this tree), overrides."""
    head, _, overrides = spec.partition("=")
    name, _, revision = head.partition("@")
    return name, revision or None, [o for o in overrides.split(",") if o]


def commit_of(revision: str) -> str:
    """The commit ``revision`` names; a name git does not know is one line, no traceback."""
    git = ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"]
    found = subprocess.run(git, capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--variant ...@{revision}: no such commit in {REPO}")
    return found.stdout.strip()


@contextlib.contextmanager
def terminated_as_exit():
    """Inside, SIGTERM raises SystemExit, so ``finally`` blocks still run (a plain SIGTERM ends
    the process without them) and ``subprocess.run`` kills the child it waits for."""

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set a handler; there SIGTERM ends the process as ever
        return
    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def worktrees(revisions: set[str], tmp: Path):
    """{revision: its grpo source folder}, from a detached git worktree of each, removed after,
    also when the run is stopped by SIGTERM."""
    trees: dict[str, Path] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(terminated_as_exit())
        stack.callback(remove_worktrees, trees)
        for rev in sorted(revisions):
            tree = tmp / f"tree-{len(trees)}"
            git = ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), rev]
            subprocess.run(git, check=True)
            trees[rev] = tree / "src"
        yield trees


def remove_worktrees(trees: dict[str, Path]) -> None:
    for src in trees.values():
        remove = ["git", "-C", str(REPO), "worktree", "remove", "--force", str(src.parent)]
        subprocess.run(remove, check=False)
    # what a failed add or remove left registered (its folder goes with the temporary one)
    subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=False)


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
    variants, revisions = {}, {}
    for spec in args.variant:
        name, revision, overrides = parse_variant(spec)
        variants[name], revisions[name] = overrides, revision
    # resolved before the runs, so a moving name (HEAD~1) is recorded as what ran
    commits = {
        name: {"revision": rev, "commit": commit_of(rev)}
        for name, rev in revisions.items()
        if rev is not None
    }
    steps = args.steps or common.SETUPS[args.setup]["steps"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        wanted = {c["commit"] for c in commits.values()}
        with worktrees(wanted, Path(tmp)) as trees:
            for r in range(args.rounds):
                for name, overrides in variants.items():
                    out = Path(tmp) / f"{name}-{r}.json"
                    src = trees.get(commits[name]["commit"]) if name in commits else None
                    result = run_variant(args.setup, steps, r, overrides, out, src)
                    print(
                        f"round {r} {name}: median step {result['median_step_s']:.3f} s, "
                        f"peak RSS {result['peak_rss_mb']:.0f} MiB",
                        flush=True,
                    )
                    runs.append({"variant": name, "round": r, **result})
    summary = {"setup": args.setup, "steps": steps, "rounds": args.rounds}
    summary["revisions"] = commits
    summary["variants"] = summarize(variants, runs)
    out = args.out or RESULTS / f"options_{args.setup}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
