"""An environment class beyond the training loop: ``grpo eval`` plays greedy episodes,
``grpo curate`` samples them, and a producer process (``rollout.max_staleness: 1``) imports the
class again."""

from __future__ import annotations

import json
from pathlib import Path

import trl_envs
import yaml

import grpo
from grpo.cli import main

HERE = Path(__file__).parent
ENVS = HERE / "trl_envs.py"


def _recipe(tmp_path: Path, tiny_model_dir: Path, cls: str = "HighNumber") -> Path:
    rows = [{"prompt": f"Game {i}.", "answer": "x"} for i in range(6)]
    (tmp_path / "games.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = {
        "model": {"name": str(tiny_model_dir), "precision": "float32"},
        "data": {"path": str(tmp_path / "games.jsonl"), "eval_path": str(tmp_path / "games.jsonl")},
        "rollout": {"environment": f"{ENVS}:{cls}", "group_size": 3, "max_new_tokens": 8},
        "rewards": {"functions": [{"name": "environment"}]},
        "train": {"output_dir": str(tmp_path / "runs"), "progress": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_eval_plays_greedy_episodes_and_reports_them(tmp_path, tiny_model_dir, capsys) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    assert main(["eval", str(tiny_model_dir), "--recipe", str(recipe), "--examples", "4"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert metrics["env/turns"] == 1.0 and metrics["env/errors"] == 0.0
    assert {"env/done_frac", "env/failed_frac", "env/time_s", "time/env_s"} <= set(metrics)
    assert "reward/environment/mean" in metrics


def test_curate_scores_rows_by_their_episodes(tmp_path, tiny_model_dir, capsys) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    out = tmp_path / "kept.jsonl"
    assert main(["curate", str(recipe), "--samples", "3", "--output", str(out)]) == 0
    scores = [
        json.loads(line) for line in (tmp_path / "kept.scores.jsonl").read_text().splitlines()
    ]
    # one seed a prompt, one hidden number a group: its three samples score alike
    assert [len(set(s["sample_rewards"])) for s in scores] == [1] * 6
    assert {r for s in scores for r in s["sample_rewards"]} <= {0.0, 1.0}


def test_a_producer_process_imports_the_class_again(tiny_config, tmp_path: Path) -> None:
    config = tiny_config(
        rollout={"environment": None, "max_staleness": 1, "max_new_tokens": 8},
        algorithm={"tis_cap": 2.0},
        rewards={"functions": [{"name": "environment"}, {"name": "format"}]},
        train={"steps": 2},
    )
    run_dir = grpo.train(config, environment=trl_envs.HighNumber)  # pickled by reference
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert len(steps) == 2 and all(r["env/turns"] == 1.0 for r in steps)
    assert all(0.0 <= r["reward/environment/mean"] <= 1.0 for r in steps)
