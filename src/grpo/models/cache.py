"""Where built models are kept, and the one-line error of a model name that cannot be used.

Aliases and GGUF files are built or converted once into a folder under ``$GRPO_CACHE``
(default ``~/.cache/grpo/models``) and loaded from there afterwards.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


class ModelError(ValueError):
    """A model name that cannot be resolved; one line for the user."""


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo" / "models"))


def is_cached(alias: str) -> bool:
    return (cache_root() / alias / "config.json").is_file()


def build_once(target: Path, build: Callable[[Path], Path]) -> str:
    """``target`` built by ``build`` unless it is already there (an HF folder with config.json),
    under a temporary name renamed when complete, so an interrupted build is never mistaken
    for a model."""
    if not (target / "config.json").is_file():
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
    return str(target)
