"""Config loading: how command-line overrides meet a recipe, and the per-task recipes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from grpo.config import (
    ConfigError,
    build_config,
    default_recipe_path,
    load_config,
    merge_trees,
    parse_overrides,
    read_recipe,
)
from grpo.config.loading import _drop_other_task_args

RECIPES = default_recipe_path().parent
DEFAULT_TASK_ARGS = read_recipe(default_recipe_path())["data"]["task_args"]


def test_overrides_are_typed_and_nested() -> None:
    assert parse_overrides(["rollout.group_size=16", "model.lora.enabled=true", "a.b=x"]) == {
        "rollout": {"group_size": 16},
        "model": {"lora": {"enabled": True}},
        "a": {"b": "x"},
    }


def test_switching_task_drops_the_recipes_task_args() -> None:
    assert DEFAULT_TASK_ARGS  # the default recipe's arithmetic arguments
    config = load_config(None, ["data.task=gsm8k"])
    assert config.data.task == "gsm8k" and config.data.task_args == {}


def test_switching_task_takes_only_the_task_args_given_with_it() -> None:
    config = load_config(None, ["data.task=countdown", "data.task_args.size=10"])
    assert config.data.task_args == {"size": 10}


def test_same_task_again_keeps_the_recipes_task_args() -> None:
    assert load_config(None, ["data.task=arithmetic"]).data.task_args == DEFAULT_TASK_ARGS


def test_setting_path_leaves_task_args(tmp_path: Path) -> None:
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    config = load_config(None, [f"data.path={data}"])
    assert config.data.path == str(data) and config.data.task_args == DEFAULT_TASK_ARGS


def test_recipe_without_task_switches_from_the_default_task(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"task_args": {"size": 8}}}))  # arithmetic
    assert load_config(recipe, ["data.task=arithmetic"]).data.task_args == {"size": 8}
    assert load_config(recipe, ["data.task=gsm8k"]).data.task_args == {}


def test_empty_mapping_override_clears() -> None:
    assert load_config(None, ["data.task_args={}"]).data.task_args == {}


def test_mapping_override_merges_key_by_key() -> None:
    config = load_config(None, ["data.task_args.size=10"])
    assert config.data.task_args == {**DEFAULT_TASK_ARGS, "size": 10}
    config = load_config(None, ["data.task_args={size: 10}"])
    assert config.data.task_args == {**DEFAULT_TASK_ARGS, "size": 10}


def test_merge_trees() -> None:
    base = {"a": {"x": 1, "y": 2}, "b": 3}
    assert merge_trees(base, {"a": {"x": 5}}) == {"a": {"x": 5, "y": 2}, "b": 3}
    assert merge_trees(base, {"a": {}}) == {"a": {}, "b": 3}
    assert merge_trees(base, {"b": {}}) == {"a": {"x": 1, "y": 2}, "b": {}}
    assert base == {"a": {"x": 1, "y": 2}, "b": 3}  # not changed in place


@pytest.mark.parametrize(
    ("recipe", "task", "rewards"),
    [
        ("gsm8k", "gsm8k", ["accuracy", "tag_count"]),
        ("math500", "math500", ["format", "accuracy"]),
        ("humaneval", "humaneval", ["code"]),
        ("countdown", "countdown", ["format", "countdown"]),
    ],
)
def test_task_recipes_resolve(recipe: str, task: str, rewards: list[str]) -> None:
    config = load_config(RECIPES / f"{recipe}.yaml")
    assert config.data.task == task and config.data.path is None
    assert [spec.name for spec in config.rewards.functions] == rewards
    assert config.model.name == "smollm2-135m-instruct"
    assert config.train.run_name == recipe
    if task in ("math500", "humaneval"):  # test split only
        assert config.data.split == "test" and config.train.eval_every == 0
    if task == "gsm8k":
        assert config.rollout.max_new_tokens >= 256
        assert "<answer></answer>" in config.data.system_prompt


def test_merge_trees_goes_as_deep_as_the_mappings_and_replaces_the_rest() -> None:
    base = {"a": {"b": {"c": 1, "d": [1, 2]}, "e": 2}}
    # a list is a value: replaced whole, never merged item by item
    assert merge_trees(base, {"a": {"b": {"d": [3]}}}) == {"a": {"b": {"c": 1, "d": [3]}, "e": 2}}
    # a mapping over a value replaces it, and a value over a mapping too
    assert merge_trees({"a": 1}, {"a": {"x": 1}}) == {"a": {"x": 1}}
    assert merge_trees(base, {"a": {"b": None}}) == {"a": {"b": None, "e": 2}}
    assert merge_trees({}, {"n": {"m": 1}}) == {"n": {"m": 1}}


RECIPE = {"data": {"task": "countdown", "task_args": {"size": 8}, "split": "train"}}
WITHOUT_ARGS = {"data": {"task": "countdown", "split": "train"}}
DEFAULT_TASKS_ARGS = {"data": {"task_args": {"size": 8}}}  # no task: the default, arithmetic


@pytest.mark.parametrize(
    ("recipe", "overrides", "dropped"),
    [
        (RECIPE, {"data": {"task": "gsm8k"}}, WITHOUT_ARGS),  # another task: its args go
        (RECIPE, {"data": {"task": "countdown"}}, None),  # the same task again
        (RECIPE, {"data": {"path": "x.jsonl"}}, None),  # no task given
        (RECIPE, {"train": {"steps": 3}}, None),
        (DEFAULT_TASKS_ARGS, {"data": {"task": "arithmetic"}}, None),
        (DEFAULT_TASKS_ARGS, {"data": {"task": "gsm8k"}}, {"data": {}}),
        # nothing to drop, or an override that is no section
        ({"data": {"task": "countdown"}}, {"data": {"task": "gsm8k"}}, None),
        (RECIPE, {"data": "x"}, None),
    ],
)
def test_only_a_switch_to_another_task_drops_the_recipes_task_args(
    recipe: dict, overrides: dict, dropped: dict | None
) -> None:
    """``dropped``: the recipe without its task_args; None: the recipe itself, unchanged."""
    before = str(recipe)
    out = _drop_other_task_args(recipe, overrides)
    assert out is recipe if dropped is None else out == dropped
    assert str(recipe) == before  # never changed in place


@pytest.mark.parametrize(
    ("algorithm", "said"),
    [
        (
            {"sapo_tau_pos": 2.0},
            "algorithm.sapo_tau_pos is set but not used: it applies only with loss_type sapo",
        ),
        (
            {"loss_type": "dapo", "cispo_clip_high": 2.0},
            "algorithm.cispo_clip_high is set but not used: it applies only with loss_type cispo",
        ),
        (
            {"entropy_coef_step": 0.1},
            "algorithm.entropy_coef_step is set but not used: it applies only with entropy_target",
        ),
        ({"lam": 0.9}, "algorithm.lam is set but not used: it applies only with estimator ppo"),
        (
            {"estimator": "rloo", "critic_lr": 1e-4},
            "algorithm.critic_lr is set but not used: it applies only with estimator ppo",
        ),
        (
            {"beta": 0.1, "ref_mix_alpha": 0.5},
            "algorithm.ref_mix_alpha is set but not used: it applies only with ref_update_every",
        ),
    ],
)
def test_a_knob_that_nothing_reads_is_one_line(algorithm: dict, said: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_config({"algorithm": algorithm})


@pytest.mark.parametrize("key", ["pack_float32", "compile"])
def test_hf_engine_knobs_are_refused_with_vllm(key: str) -> None:
    assert getattr(build_config({"rollout": {key: True}}).rollout, key)
    server = {key: True, "engine": "server"}  # its server's engine must say the same
    assert getattr(build_config({"rollout": server}).rollout, key)
    with pytest.raises(ConfigError, match=rf"rollout.{key} is set but not used.*engine hf"):
        build_config({"rollout": {key: True, "engine": "vllm"}})


def test_a_knob_with_its_setting_is_taken() -> None:
    algo = build_config(
        {"algorithm": {"estimator": "ppo", "lam": 0.9, "loss_type": "sapo", "sapo_tau_pos": 2.0}}
    ).algorithm
    assert (algo.lam, algo.sapo_tau_pos) == (0.9, 2.0)


@pytest.mark.parametrize("value", [True, 1.5, "1"])
def test_max_staleness_is_a_whole_number_not_a_yes(value: object) -> None:
    # YAML's `true` would otherwise be read as 1 step of staleness without a word
    with pytest.raises(ConfigError, match=r"^config 'rollout.max_staleness': Input should be a"):
        build_config({"rollout": {"max_staleness": value}, "algorithm": {"tis_cap": 2.0}})
    config = load_config(None, ["rollout.max_staleness=2", "algorithm.tis_cap=2.0"])
    assert config.rollout.max_staleness == 2
