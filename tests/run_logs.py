"""What a run logged, for tests that compare runs: its step rows without timings."""

from __future__ import annotations

import json
from pathlib import Path


def step_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without timings and event rows: what must match an uninterrupted run."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_s"}
        for row in map(json.loads, lines)
        if "event" not in row
    ]
