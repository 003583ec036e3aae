"""Rewards the tiny random model can move from its first step (used through tests/conftest.py).

The tiny model's vocabulary is ~100 printable characters, so a random completion of 12 tokens
has a lowercase share near 0.27 that differs between any two samples: every group has a
non-zero advantage from step 1, and raising the share is learnable.
"""

from __future__ import annotations

import string
from typing import Any

LOWERCASE = frozenset(string.ascii_lowercase)


def lowercase_share(completions: list[str], **_: Any) -> list[float]:
    """Share of a completion's characters that are lowercase ASCII letters (0 when empty)."""
    return [sum(c in LOWERCASE for c in text) / max(len(text), 1) for text in completions]
