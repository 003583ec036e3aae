"""Shared fixtures: a tiny random model and tokenizer built locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.config import Config, build_config
from grpo.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 64) with a character tokenizer and a chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    # aliases build into a per-session cache, never into the user's home
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path_factory.getbasetemp() / "model-cache"))
    torch.manual_seed(0)


@pytest.fixture
def tiny_config(tiny_model_dir: Path, tmp_path: Path):
    """A factory: tiny_config(**sections) -> Config for a fast run in tmp_path."""

    def make(**sections: dict) -> Config:
        tree: dict = {
            "model": {"name": str(tiny_model_dir)},
            "data": {"task": "arithmetic", "task_args": {"size": 64}},
            "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
            "optim": {"lr": 1e-3, "micro_batch_size": 4},
            "train": {
                "steps": 2,
                "output_dir": str(tmp_path / "runs"),
                "run_name": "t",
                "progress": False,
                "sinks": ["jsonl"],
            },
        }
        for key, value in sections.items():
            tree[key] = {**tree.get(key, {}), **value}
        return build_config(tree)

    return make
