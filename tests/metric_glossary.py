"""The metric names documented in the glossary, docs/metrics.md (for the tests that check that
every logged metric is there)."""

from __future__ import annotations

import re
from pathlib import Path

GLOSSARY = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def documented_metrics() -> set[str]:
    section = GLOSSARY.read_text()  # the whole page is the glossary
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names
