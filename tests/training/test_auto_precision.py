"""`model.precision` in a run: `auto` becomes a concrete setting before anything reads or saves
it, says so in one line, and a resume on a machine that decides otherwise says the change."""

from __future__ import annotations

import json

import pytest
import yaml

import grpo.eval
from grpo import build
from grpo.config import ConfigError, build_config
from grpo.runtime.precision import MatmulRates
from grpo.training.trainer import Trainer


def measured(float32: float, bfloat16: float):
    """A stand-in for this machine's measurement."""
    return lambda device, hidden, intermediate: MatmulRates(float32, bfloat16)


@pytest.mark.parametrize(("bf16", "chosen"), [(900.0, "bf16_autocast"), (150.0, "float32")])
def test_auto_becomes_the_measured_choice_with_its_line(
    tiny_config, monkeypatch, capsys, bf16: float, chosen: str
) -> None:
    shapes = []
    monkeypatch.setattr(
        build, "measure_rates", lambda *args: shapes.append(args[1:]) or MatmulRates(300.0, bf16)
    )
    config = tiny_config(model={"precision": "auto"})
    trainer = Trainer(config)
    assert shapes == [(64, 128)]  # the tiny model's MLP: hidden 64 x intermediate 128
    assert trainer.config.model.precision == chosen
    assert trainer.config.model.autocast is (chosen == "bf16_autocast")
    assert config.model.precision == "auto"  # the caller's config is left as it was
    line = f"model.precision auto: {chosen} (matmul on cpu, "
    assert line in capsys.readouterr().err


@pytest.mark.device
def test_auto_measures_for_real_on_this_machine(tiny_config, capsys) -> None:
    trainer = Trainer(tiny_config(model={"precision": "auto"}))
    out = capsys.readouterr().err
    assert trainer.config.model.precision in ("float32", "bf16_autocast")
    assert f"model.precision auto: {trainer.config.model.precision}" in out
    assert out.count("GFLOP/s") == 2


def test_a_recipe_that_names_no_precision_is_measured(
    monkeypatch, tiny_model_dir, tmp_path
) -> None:
    monkeypatch.setattr(build, "measure_rates", measured(300.0, 900.0))
    config = build_config(
        {"model": {"name": str(tiny_model_dir)}, "train": {"output_dir": str(tmp_path)}}
    )
    assert config.model.precision == "auto"
    assert Trainer(config).config.model.precision == "bf16_autocast"


def test_a_set_precision_is_not_measured(tiny_config, monkeypatch, capsys) -> None:
    monkeypatch.setattr(build, "measure_rates", pytest.fail)
    trainer = Trainer(tiny_config(model={"precision": "bf16_autocast"}))
    assert trainer.config.model.autocast
    assert "model.precision auto" not in capsys.readouterr().err


def test_an_undecided_auto_is_never_read_as_float32() -> None:
    config = build_config({"model": {"precision": "auto"}})
    with pytest.raises(RuntimeError, match=r"model\.precision=auto"):
        config.model.autocast  # noqa: B018


def test_older_recipes_autocast_key_still_works() -> None:
    assert build_config({"model": {"autocast": True}}).model.precision == "bf16_autocast"
    assert build_config({"model": {"autocast": False}}).model.precision == "float32"
    both = {"model": {"autocast": True, "precision": "bf16_autocast"}}
    assert build_config(both).model.precision == "bf16_autocast"
    with pytest.raises(ConfigError, match=r"model\.autocast=true and model\.precision=float32"):
        build_config({"model": {"autocast": True, "precision": "float32"}})


def test_the_run_records_the_choice_and_a_resume_that_decides_otherwise_says_so(
    tiny_config, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(build, "measure_rates", measured(300.0, 150.0))
    run_dir = Trainer(tiny_config(model={"precision": "auto"}, train={"steps": 1})).train()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["precision"] == "float32"  # what ran, not "auto"
    # the same run resumed on a machine with bf16 units: trained on in bf16, the change said
    monkeypatch.setattr(build, "measure_rates", measured(300.0, 1500.0))
    capsys.readouterr()
    resumed = Trainer(tiny_config(model={"precision": "auto"}, train={"steps": 2}))
    assert resumed.plan.step == 1 and resumed.config.model.precision == "bf16_autocast"
    resumed.train()
    assert "from step 1 model.precision 'float32' -> 'bf16_autocast'" in capsys.readouterr().out
    history = [json.loads(line) for line in (run_dir / "config_history.jsonl").open()]
    assert history[-1]["changed"]["model.precision"] == ["float32", "bf16_autocast"]


@pytest.mark.parametrize(("bf16", "chosen"), [(900.0, True), (150.0, False)])
def test_grpo_eval_decides_auto_too_and_samples_in_its_choice(
    tiny_config, monkeypatch, capsys, bf16: float, chosen: bool
) -> None:
    # `grpo eval` on a recipe that says auto (the default one): measured, said, and generation
    # runs in the choice, never in an undecided "auto"
    monkeypatch.setattr(build, "measure_rates", measured(300.0, bf16))
    seen = []
    bf16_autocast = grpo.eval.bf16_autocast
    monkeypatch.setattr(
        grpo.eval,
        "bf16_autocast",
        lambda device, enabled, **kw: seen.append(enabled) or bf16_autocast(device, enabled, **kw),
    )
    config = tiny_config(model={"precision": "auto"}, train={"eval_every": 1})
    result = grpo.eval.evaluate_config(config, samples=1, examples=2)
    assert seen == [chosen] and "accuracy" in result
    want = "bf16_autocast" if chosen else "float32"
    said = capsys.readouterr()
    assert f"model.precision auto: {want} (matmul on cpu" in said.err
    assert "model.precision" not in said.out  # stdout is `grpo eval`'s JSON
