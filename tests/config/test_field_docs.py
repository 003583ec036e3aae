"""Settings' docstrings say what a setting does; what it measured lives in docs/results/, where a
new measurement replaces the old one, and a docstring links there (``measured: docs/results/...``).
A number that was measured would go stale silently in the docstring and in the generated
docs/config-reference.md."""

from __future__ import annotations

import re
from collections.abc import Iterator

from pydantic import BaseModel

from grpo.config import Config, Section

# a number with a unit of time, memory, speed or a ratio: how a measurement reads
MEASURED = re.compile(
    r"\d+(?:[.,]\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s*"
    r"(?:ms|s|min|x|%|KiB|MiB|GiB|KB|MB|GB|tokens/s|GFLOP/s)(?![\w/])"
)
# numbers that are the setting's own: a default, a threshold or a size the code uses
ALLOWED = {
    "model.precision": {"1.3x"},  # `auto` chooses bf16 at this speed-up
    "model.chunked_head": {"32 MiB"},  # the chunk's size under plain sampling
    "rollout.vllm_kv_cache_gb": {"1 GiB"},  # the CPU default
}


def field_docs(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, docstring) of every setting."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            yield from field_docs(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.description or ""


def test_the_pattern_finds_measurements() -> None:
    text = "steps 0.53x, 540 MB, 1.08-1.20x, 12 %, 9.4 s, 249 tokens/s; not 5e-6, G = 8, 1e-4"
    assert MEASURED.findall(text) == [
        "0.53x",
        "540 MB",
        "1.08-1.20x",
        "12 %",
        "9.4 s",
        "249 tokens/s",
    ]


def test_no_setting_quotes_a_measurement() -> None:
    found = {
        key: numbers
        for key, doc in field_docs()
        if (numbers := set(MEASURED.findall(doc)) - ALLOWED.get(key, set()))
    }
    assert not found, f"move these to docs/results/ and link the page: {found}"


def test_the_allowed_numbers_are_still_there() -> None:
    docs = dict(field_docs())
    stale = {key: numbers - set(MEASURED.findall(docs[key])) for key, numbers in ALLOWED.items()}
    assert not any(stale.values()), f"drop from ALLOWED: {stale}"
