"""Differences between two configs as dotted keys: ``{"a": {"b": 1}}`` is ``a.b``."""

from __future__ import annotations

from typing import Any


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay whole values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(
    old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None
) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs: key -> (old, new). A key ``old`` lacks (a newer grpo
    added it) had its value in ``defaults`` (the new config's defaults) then, so it changed only
    where the new value is not the default; without ``defaults`` a missing side is None."""
    a, b = flatten(old), flatten(new)
    base = flatten(defaults or {})
    a = {**{k: base[k] for k in b.keys() - a.keys() if k in base}, **a}
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
