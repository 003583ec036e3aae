"""The fault matrix's cells (docs/checkpoints.md, "Faults across processes"): a test that
injects a fault across a process boundary records the seconds from the fault to the stop (or
to the failed call) and the line said, for ``python -m benchmarks.infra.faults``, which runs
them with ``GRPO_FAULT_TIMES`` naming a JSON-lines file. Without it nothing is written."""

from __future__ import annotations

import json
import os


def record(cell: str, seconds: float, line: str) -> None:
    """One measured cell (``boundary/fault``), appended where ``GRPO_FAULT_TIMES`` says."""
    path = os.environ.get("GRPO_FAULT_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"cell": cell, "seconds": round(seconds, 2), "line": line}) + "\n")
