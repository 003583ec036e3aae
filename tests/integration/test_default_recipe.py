"""The default recipe on the real SmolLM2-135M-Instruct, reduced: the format holds, steps train.

Slow (tens of minutes on 2 busy cores): `make test-slow`. The run is seeded and CPU runs repeat
exactly, so the outcome is fixed for a given machine and library versions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.config import default_recipe_path, load_config, read_recipe
from grpo.runs.report import write_report
from grpo.training.trainer import train


def test_default_recipe_is_the_real_model_with_held_out_eval() -> None:
    recipe = read_recipe(default_recipe_path())
    assert recipe["model"]["name"] == "smollm2-135m-instruct"
    config = load_config()
    assert config.model.precision == "auto"  # measured on the machine it runs on
    assert config.train.eval_every > 0
    assert config.train.steps >= 20  # first and last 10 steps do not overlap
    names = [spec.name for spec in config.rewards.functions]
    assert "accuracy" in names and "tag_count" in names


@pytest.mark.slow
def test_reduced_default_recipe_writes_the_tag_and_trains(tmp_path: Path) -> None:
    steps = 16
    config = load_config(
        None,
        [
            f"train.steps={steps}",
            f"train.output_dir={tmp_path}",
            "train.eval_every=8",
            "train.eval_examples=20",
            "train.save_every=0",
            "train.progress=false",
            "train.sinks=[jsonl]",
        ],
    )
    run_dir = train(config)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "reward/mean" in x]
    assert len(trained) == steps
    # the few-shot turns give the format from the start; training must not lose it
    evals = [x for x in lines if "eval/accuracy" in x]
    assert len(evals) == 3  # before training, step 8, step 16
    assert all(x["eval/answer_rate"] >= 0.8 for x in evals), evals
    # most steps carry a gradient (mixed groups), and the policy does not collapse
    assert sum(x["grad_norm"] > 0 for x in trained) >= steps // 2
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] - 0.1, evals
    assert "data:image/png;base64," in write_report(run_dir).read_text()
