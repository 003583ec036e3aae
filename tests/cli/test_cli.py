"""The command line: overrides, and bad input that ends in one line, exit code 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo.cli import USER_ERRORS, main
from grpo.config import ConfigError, load_config


def _recipe(tmp_path: Path, tiny_model_dir: Path, **extra) -> Path:
    tree = {
        "model": {"name": str(tiny_model_dir), "precision": "float32"},
        "data": {"task": "arithmetic", "task_args": {"size": 16}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "train": {
            "steps": 1,
            "output_dir": str(tmp_path / "runs"),
            "progress": False,
            "sinks": ["jsonl"],
        },
    }
    for key, value in extra.items():
        tree[key] = {**tree.get(key, {}), **value}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_recipe_plus_overrides(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = load_config(_recipe(tmp_path, tiny_model_dir), ["rollout.group_size=16"])
    assert config.rollout.group_size == 16
    assert config.train.run_name == "recipe"  # runs land in runs/<recipe name> by default


def test_train_writes_the_resolved_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    assert main(["train", str(recipe), "optim.lr=0.001"]) == 0
    saved = yaml.safe_load((tmp_path / "runs" / "recipe" / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 0.001 and saved["rollout"]["group_size"] == 2
    assert saved["algorithm"]["clip_low"] == 0.2  # defaults are written out too


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.nope=1", "unknown config key 'rollout.nope'"),
        ("rollout.group_size=abc", "config 'rollout.group_size'"),
        (
            "rollout.group_size=1",
            "config 'rollout.group_size': Input should be greater than or equal to 2",
        ),
        ("optim.lr=.inf", "config 'optim.lr': Input should be a finite number"),
        ("train.run_name=2024-01-01", "got a date (values are read as YAML: quote it, train.run"),
        ("rewards.fallback=.nan", "config 'rewards.fallback': Input should be a finite number"),
        ("optim.betas=[1.5,0.9]", "config 'optim.betas.0': Input should be less than 1"),
        ("data.path=/no/such/file.jsonl", "data file not found: /no/such/file.jsonl"),
        ("rewards.functions=[{name: no_such_module:fn}]", "cannot import module 'no_such_module'"),
        ("rewards.functions=[{name: nope}]", "unknown reward 'nope'"),
        ("model.name=/no/such/model", "model '/no/such/model' is neither an alias"),
        ("bogus", "is not of the form key=value"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, tiny_model_dir: Path, capsys, override: str, message: str
) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    run_dir = tmp_path / "runs" / "recipe"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", str(recipe), override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert [p.name for p in run_dir.iterdir()] == ["metrics.jsonl"]
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_bf16_weights_under_fsdp_are_one_line(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    # FSDP2 would step the sharded bf16 weights themselves, rounding most updates away
    recipe = _recipe(tmp_path, tiny_model_dir)
    assert main(["train", str(recipe), "model.dtype=bfloat16", "train.distributed=fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.distributed=fsdp keeps no float32 master weights" in err and "\n" not in err
    assert not (tmp_path / "runs").exists()


def test_row_without_prompt_is_named(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+1", "answer": "2"}) + "\n" + json.dumps({"q": "x"}) + "\n"
    )
    recipe = _recipe(tmp_path, tiny_model_dir, data={"path": str(data)})
    assert main(["train", str(recipe)]) == 2
    assert f"{data}: row 2 has no 'prompt' field" in capsys.readouterr().err


def test_missing_recipe(capsys) -> None:
    assert main(["train", "/no/recipe.yaml"]) == 2
    assert "recipe file not found: /no/recipe.yaml" in capsys.readouterr().err


def test_unknown_key_in_recipe_is_a_config_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir, optim={"learning_rate": 1.0})
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.learning_rate'"):
        load_config(recipe)


def test_console_script_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    grpo = Path(sys.executable).parent / "grpo"
    done = subprocess.run(
        [str(grpo), "train", str(recipe)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "runs" / "recipe" / "metrics.jsonl").read_text().count("\n") == 1


def test_a_task_brings_its_default_rewards() -> None:
    from grpo.config import build_config

    humaneval = build_config({"data": {"task": "humaneval", "split": "test"}})
    assert [f.name for f in humaneval.rewards.functions] == ["code"]
    # a preset extends the task's defaults; the resolved config reloads to the same config
    dapo = build_config({"data": {"task": "countdown"}, "algorithm": {"preset": "dapo"}})
    assert [f.name for f in dapo.rewards.functions] == ["format", "countdown", "overlong"]
    assert build_config(dapo.model_dump(mode="json")) == dapo
    # rewards a recipe names win
    own = build_config(
        {"data": {"task": "countdown"}, "rewards": {"functions": [{"name": "format"}]}}
    )
    assert [f.name for f in own.rewards.functions] == ["format"]


def test_config_command_accepts_overrides_without_a_recipe(capsys) -> None:
    assert main(["config", "rollout.group_size=3"]) == 0
    assert "group_size: 3" in capsys.readouterr().out


def test_docs_config_reference_is_current() -> None:
    from grpo.config import reference_markdown

    page = (Path(__file__).resolve().parents[2] / "docs" / "config-reference.md").read_text()
    block = page.split("<!-- config-reference:start -->\n", 1)[1]
    block = block.split("<!-- config-reference:end -->", 1)[0]
    assert block == reference_markdown(), "regenerate with: make docs"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"rollout: {group_size: 16}\noptim: {lr: 0.1}\nrollout: {max_new_tokens: 9}\n",
            "invalid YAML at line 3, column 1: key 'rollout' is given twice",
        ),
        (b"optim:\n  lr: 0.1\n  lr: 0.2\n", "line 3, column 3: key 'lr' is given twice"),
        (b"model:\n  name: caf\xe9\n", "is not UTF-8 text"),
    ],
)
def test_a_recipe_that_would_lose_a_setting_is_one_line(
    tmp_path: Path, capsys, content: bytes, message: str
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content)
    assert main(["config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


@pytest.mark.parametrize(("module", "name"), sorted(USER_ERRORS.items()))
def test_each_one_line_error_is_where_the_command_line_looks_for_it(
    module: str, name: str, monkeypatch, capsys
) -> None:
    # the command line catches these by module and name (importing them would load torch): a
    # class that moved would be a traceback again
    import importlib

    import grpo.cli

    error = getattr(importlib.import_module(module), name)
    assert isinstance(error, type) and issubclass(error, Exception)

    def fails(args) -> int:
        raise error("the one line")

    monkeypatch.setitem(grpo.cli.COMMANDS, "config", fails)
    assert main(["config"]) == 2
    assert capsys.readouterr().err == "grpo: error: the one line\n"
