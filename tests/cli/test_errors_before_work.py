"""Errors caught before any work: one line, exit 2, before the model loads; and the CLI's manners."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import _recipe as cli_recipe

import grpo.build
import grpo.models.aliases
from grpo.cli import build_parser, main, parse_args
from grpo.config import ConfigError, load_config


def _recipe(tmp_path: Path, tiny_model_dir: Path, **train: object) -> Path:
    """test_cli's one-step recipe, with ``train.*`` overrides."""
    return cli_recipe(tmp_path, tiny_model_dir, train=train)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo: error: ") and "\n" not in err, err
    return err


@pytest.fixture
def no_model_load(monkeypatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(grpo.build, "load_policy", refuse)


def test_an_output_dir_that_cannot_be_written_fails_before_the_model_loads(
    tmp_path: Path, tiny_model_dir: Path, capsys, no_model_load
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    recipe = _recipe(tmp_path, tiny_model_dir, output_dir=str(blocker))
    assert main(["train", str(recipe)]) == 2
    assert f"train.output_dir: cannot write to {blocker}/recipe" in _one_line(capsys)


def test_a_changed_config_fails_before_the_model_loads(
    tmp_path: Path, tiny_model_dir: Path, capsys, monkeypatch
) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    assert main(["train", str(recipe)]) == 0
    monkeypatch.setattr(grpo.build, "load_policy", None)  # calling it would fail loudly
    assert main(["train", str(recipe), "train.steps=2", "train.seed=7"]) == 2
    assert "changes the math: train.seed 0 -> 7;" in _one_line(capsys)


def test_an_unknown_hub_id_fails_at_once_offline(monkeypatch, capsys) -> None:
    import socket

    from huggingface_hub import constants

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("offline: nothing may try the network")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(grpo.models, "load_policy", no_network)
    assert main(["eval", "runs/nope"]) == 2
    err = _one_line(capsys)
    assert "model 'runs/nope' is neither an alias" in err and "HF_HUB_OFFLINE is set" in err


def test_an_unreachable_hub_fails_at_once(monkeypatch, capsys) -> None:
    import socket

    from huggingface_hub import constants

    def unreachable(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    assert main(["eval", "someone/some-model"]) == 2
    assert "huggingface.co cannot be reached: Name or service not known" in _one_line(capsys)


def test_eval_of_a_run_without_a_complete_final_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "runs" / "recipe"
    (run / "final" / "model.safetensors").unlink()  # what a kill during its write could leave
    assert main(["eval", str(run), "--examples", "1"]) == 2
    assert f"{run}/final is damaged; its newest complete checkpoint is" in _one_line(capsys)
    # a checkpoint inside the run is checked as well
    (run / "checkpoints" / "step-1" / "trainer_state.pt").write_bytes(b"")
    assert main(["eval", str(run / "checkpoints" / "step-1")]) == 2
    assert "step-1 is damaged: trainer_state.pt has 0 bytes" in _one_line(capsys)


def test_eval_takes_options_and_overrides_in_any_order(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir)
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "runs" / "recipe"
    capsys.readouterr()
    assert main(["eval", str(run), "--examples", "2", "rollout.max_new_tokens=3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == str(run / "final") and "accuracy" in result["metrics"]
    args = parse_args(build_parser(), ["eval", "RUN", "a.b=1", "--examples", "5", "c.d=2"])
    assert (args.model, args.examples, args.overrides) == ("RUN", 5, ["a.b=1", "c.d=2"])
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["eval", "RUN", "--nope"])


def test_train_takes_the_recipe_anywhere(tmp_path: Path, tiny_model_dir: Path) -> None:
    from grpo.cli import _config_from_args

    recipe = _recipe(tmp_path, tiny_model_dir)
    args = parse_args(build_parser(), ["train", "rollout.group_size=3", str(recipe)])
    config = _config_from_args(args)
    assert config.rollout.group_size == 3 and config.train.run_name == "recipe"


def test_version_and_help(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"grpo {version('grpo')}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "grpo config --reference" in capsys.readouterr().out
    assert main(["config", "--reference"]) == 0
    assert "| `optim.lr` |" in capsys.readouterr().out


def test_yaml_errors_name_the_line_and_column(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  steps: 3\n  sinks: [jsonl\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML at line 4, column 1: expected"):
        load_config(recipe)
    recipe.write_text("train:\n  steps: 3\n run_name: x\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line 3, column 2"):
        load_config(recipe)


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("optim.lrr=1", "optim.lr"),
        ("train.group_size=4", "rollout.group_size"),  # the right name in another section
        ("rewards.functions=[{nme: format}]", "rewards.functions.0.name"),
        ("algorithm.betta=0.1", "algorithm.beta"),
    ],
)
def test_an_unknown_key_suggests_the_closest(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=rf"did you mean '{suggestion}'\?"):
        load_config(None, [override])


def test_a_hub_id_the_hub_does_not_know_is_one_line(monkeypatch, capsys) -> None:
    import transformers

    def not_found(*args: object, **kwargs: object) -> None:
        # what transformers raises for a repository the hub does not have
        raise OSError(
            "someone/nope is not a local folder and is not a valid model identifier\nmore"
        )

    monkeypatch.setattr(grpo.models.aliases, "check_hub_id", lambda name: None)  # as if online
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", not_found)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", not_found)
    assert main(["eval", "someone/nope"]) == 2
    assert "model 'someone/nope': someone/nope is not a local folder" in _one_line(capsys)
