"""What a run logged, for tests that compare runs: its step rows without timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def step_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without timings and event rows: what must match an uninterrupted run."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_s"}
        for row in map(json.loads, lines)
        if "event" not in row
    ]


def kill_chain(tree: dict, out: Path, seed: int, timeout: float) -> list[dict]:
    """Train ``tree`` in ``out`` through ``tests/integration/kill_chain.py``'s chain of SIGKILLs
    (``seed``: of the random kill points); one dict per life, the uninterrupted run first."""
    script = Path(__file__).parent / "integration" / "kill_chain.py"
    chain_tree = {**tree, "train": {**tree["train"], "output_dir": str(out)}}
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(chain_tree), str(seed)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
