"""The ``tools/*`` metrics: their values without calls, and their names in the glossary."""

from __future__ import annotations

import math
from pathlib import Path

from metric_glossary import documented_metrics
from scripted_turns import run_metrics, tool_recipe

from grpo.rollout.turns import tool_metrics
from grpo.training.trainer import train


def test_error_rate_is_undefined_without_calls() -> None:
    metrics = tool_metrics(
        [[{"text": "4", "call": None, "output": None, "error": None, "time_s": None}]]
    )
    assert metrics["tools/calls_per_completion"] == 0.0
    assert math.isnan(metrics["tools/error_rate"])


def test_every_tool_metric_is_in_the_glossary(
    tiny_config, scripted_model_dir: Path, tmp_path: Path
) -> None:
    config = tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=1)
    logged = set(run_metrics(train(config))[0])
    tools = {k for k in logged if k.startswith("tools/")}
    assert tools == {
        "tools/calls_per_completion",
        "tools/call_frac",
        "tools/error_rate",
        "tools/time_s",
        "tools/turns_per_completion",
    }
    assert tools <= documented_metrics()
