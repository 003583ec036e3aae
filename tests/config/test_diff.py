"""Differences between configs as dotted keys (what a resume compares and its history records)."""

from __future__ import annotations

from grpo.config.diff import config_changes, describe_changes, flatten


def test_flatten_names_leaves_by_dotted_keys() -> None:
    tree = {"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}
    # lists stay whole values; an empty mapping is a value of its own (task_args={})
    assert flatten(tree) == {"a.b": 1, "a.c.d": [1, 2], "e": {}, "f": None}


def test_changes_name_each_key_with_both_values_in_key_order() -> None:
    old = {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "data": {"task_args": {"size": 8}}}
    new = {"optim": {"lr": 0.2, "betas": [0.9, 0.999]}, "data": {"task_args": {}}}
    changes = config_changes(old, new)
    assert changes == {
        "data.task_args": (None, {}),
        "data.task_args.size": (8, None),
        "optim.betas": ([0.9, 0.99], [0.9, 0.999]),
        "optim.lr": (0.1, 0.2),
    }
    assert list(changes) == sorted(changes)
    assert config_changes(old, old) == {}


def test_a_key_the_old_config_lacks_had_its_default() -> None:
    old = {"rewards": {"timeout_s": 10}}
    defaults = {"rewards": {"timeout_s": 10, "workers": 2}}
    assert config_changes(old, {"rewards": {"timeout_s": 10, "workers": 2}}, defaults) == {}
    assert config_changes(old, {"rewards": {"timeout_s": 10, "workers": 4}}, defaults) == {
        "rewards.workers": (2, 4)
    }
    # without defaults the missing side is None
    assert config_changes(old, {"rewards": {"timeout_s": 10, "workers": 2}}) == {
        "rewards.workers": (None, 2)
    }


def test_changes_are_described_in_one_line() -> None:
    changes = {"optim.lr": (1e-05, 2e-05), "model.name": ("a", "b")}
    assert describe_changes(changes) == "optim.lr 1e-05 -> 2e-05, model.name 'a' -> 'b'"
    assert describe_changes({}) == ""
