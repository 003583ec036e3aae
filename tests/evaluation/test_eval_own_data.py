"""Evaluation on one's own data: data.eval_path, `grpo eval --data`, recipe-relative paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo.cli import main
from grpo.config import load_config
from grpo.training.trainer import train


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_relative_paths_in_a_recipe_resolve_against_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "data": {"path": "data/train.jsonl", "eval_path": "data/test.jsonl"},
                "rewards": {"functions": [{"name": "rewards.py:score"}, {"name": "format"}]},
            }
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(recipe, ["data.eval_path=mine.jsonl"])
    assert config.data.path == str(folder / "data" / "train.jsonl")
    assert config.rewards.functions[0].name == f"{folder / 'rewards.py'}:score"
    assert config.rewards.functions[1].name == "format"
    # a command-line override stays relative to the working directory
    assert config.data.eval_path == "mine.jsonl"
    assert load_config(recipe).data.eval_path == str(folder / "data" / "test.jsonl")


def test_training_evaluates_on_eval_path_and_grpo_eval_names_the_file(
    tiny_config, tmp_path: Path, capsys
) -> None:
    train_rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)]
    heldout = [{"question": f"What is {a} + 2?", "answer": str(a + 2)} for a in range(3)]
    data = {
        "path": str(write_jsonl(tmp_path / "train.jsonl", train_rows)),
        "eval_path": str(write_jsonl(tmp_path / "heldout.jsonl", heldout)),
        "prompt_field": "question",
    }
    config = tiny_config(data=data, train={"steps": 1, "eval_every": 1, "eval_examples": 50})
    run_dir = train(config)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["eval/examples"] == 3  # the held-out file's rows, all of them
    assert {"eval/reward/mean", "eval/reward/pass_rate", "eval/reward/format/mean"} <= set(first)
    capsys.readouterr()
    # grpo eval on a run: its recipe's eval_path; --data: another file, named in the output
    other = write_jsonl(tmp_path / "other.jsonl", heldout[:2])
    assert main(["eval", str(run_dir), "rollout.max_new_tokens=4", "--data", str(other)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["data"] == {"path": str(other.resolve())}
    assert printed["metrics"]["examples"] == 2
    assert printed["rewards"] == [spec.model_dump() for spec in config.rewards.functions]
    assert set(printed["metrics"]) >= {"accuracy", "reward/mean", "reward/accuracy/mean"}


def test_a_single_training_file_without_eval_path_says_how_to_evaluate(
    tiny_config, tmp_path: Path, capsys
) -> None:
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"path": str(path)}}))
    code = main(["eval", str(tiny_config().model.name), "--recipe", str(recipe)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "set data.eval_path" in err and "\n" not in err


def test_grpo_eval_of_a_run_finds_the_files_its_training_found(
    tiny_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # paths relative to the working directory training ran in, as a command line gives them:
    # the run's config.yaml records them so, and they are no recipe's to take from its folder
    monkeypatch.chdir(tmp_path)
    write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"{a} + 1?", "answer": str(a + 1)} for a in range(8)]
    )
    write_jsonl(
        tmp_path / "heldout.jsonl",
        [{"prompt": f"{a} + 2?", "answer": str(a + 2)} for a in range(3)],
    )
    data = {"path": "train.jsonl", "eval_path": "heldout.jsonl"}
    run_dir = train(tiny_config(data=data, train={"steps": 1}))
    capsys.readouterr()
    assert main(["eval", str(run_dir), "rollout.max_new_tokens=4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["data"] == {"path": str((tmp_path / "heldout.jsonl").resolve())}
    assert printed["metrics"]["examples"] == 3
