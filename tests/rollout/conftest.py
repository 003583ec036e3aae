"""Fixtures of the multi-turn tests: the tiny model trained to replay the scripted exchange."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripted_turns import train_scripted


@pytest.fixture(scope="session")
def scripted_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained once for every file that replays it (``train_scripted``)."""
    return train_scripted(tiny_model_dir, tmp_path_factory.mktemp("scripted"))
