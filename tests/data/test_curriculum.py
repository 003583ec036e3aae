"""The curriculum (``data.curriculum``): the move rule on worked examples, the window, the levels
as reasoning-gym's own curricula define them, rows as a function of (level, position), and
the one-line refusals."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("reasoning_gym")

from reasoning_gym.factory import create_curriculum

from grpo.config import ConfigError, CurriculumConfig, DataConfig, build_config
from grpo.data import DataError, curriculum_of, load_dataset_rows
from grpo.data.curriculum import Curriculum, levels_of, moved, pass_rate
from grpo.data.reasoning_gym import GymError, split_seed

SUMS = {"name": "chain_sum", "size": 4}


def curriculum(**settings: object) -> Curriculum:
    config = CurriculumConfig(enabled=True, **settings)
    return Curriculum(config, levels_of(SUMS, config, seed=0))


def test_moved_one_level_past_a_bound_within_the_levels() -> None:
    kw = {"lower": 0.2, "upper": 0.8, "top": 3}
    assert moved(1, 0.9, **kw) == 2  # above upper: up
    assert moved(1, 0.8, **kw) == 1  # on the bound: stays
    assert moved(1, 0.1, **kw) == 0  # below lower: down
    assert moved(1, 0.2, **kw) == 1
    assert moved(3, 1.0, **kw) == 3  # the top stays the top
    assert moved(0, 0.0, **kw) == 0


def test_pass_rate_pools_the_windows_completions() -> None:
    # (1 + 6) passes of (4 + 8) completions
    assert pass_rate([(1, 4), (6, 8)]) == pytest.approx(7 / 12, abs=1e-12)
    assert pass_rate([]) == 0.0


def test_the_level_moves_only_with_a_full_window_which_then_starts_empty() -> None:
    c = curriculum(start_level=1, window=2, lower=0.2, upper=0.8)
    # step 1: 4 of 4 pass; window not full: stays at 1
    assert c.observe([1.0, 1.0, 1.0, 1.0]) == {"curriculum/level": 1.0, "curriculum/pass_rate": 1.0}
    assert c.level == 1
    # step 2: 2 of 4 pass (0.5 is below pass_score 1, NaN is no pass); window (4 + 2) / 8
    metrics = c.observe([1.0, 0.5, 1.0, math.nan])
    assert metrics == {"curriculum/level": 1.0, "curriculum/pass_rate": pytest.approx(6 / 8)}
    assert c.level == 1  # 6/8 = 0.75 is not above 0.8
    # step 3: window is steps 2-3, (2 + 4) / 8 = 0.75: stays; step 4: (4 + 4) / 8 = 1: up
    c.observe([1.0, 1.0, 1.0, 1.0])
    assert c.level == 1
    c.observe([1.0, 1.0, 1.0, 1.0])
    assert (c.level, c.window) == (2, [])
    # at level 2 nothing passes: two steps (a full window) at 0, down again
    assert c.observe([0.0] * 4)["curriculum/level"] == 2.0
    c.observe([0.0] * 4)
    assert c.level == 1


def test_state_round_trips() -> None:
    c = curriculum(start_level=2, window=3)
    c.observe([1.0, 0.0])
    other = curriculum(start_level=0, window=3)
    other.load_state_dict(c.state_dict())
    assert (other.level, other.window) == (2, [(1, 2)])


def test_levels_are_reasoning_gyms_own_curriculum() -> None:
    levels = levels_of(SUMS, CurriculumConfig(enabled=True), seed=0)
    assert levels.top == 10  # chain_sum: num_terms 2..12 (11 levels), num_digits 1..10
    for level in (0, 3, 10):
        ours = levels.configs(level)[0].config
        theirs = create_curriculum("chain_sum")
        theirs.set_global_level(level)
        made = theirs.generate_configuration()
        for key in ("min_terms", "max_terms", "min_digits", "max_digits"):
            assert ours[key] == getattr(made, key), (level, key)
    # level 3: num_terms 2..5, num_digits 1..4 (reasoning-gym's inclusive ranges)
    assert levels.configs(3)[0].config == {
        "min_terms": 2,
        "max_terms": 5,
        "min_digits": 1,
        "max_digits": 4,
    }


def test_chosen_attributes_move_and_the_others_keep_the_config() -> None:
    args = {**SUMS, "config": {"min_digits": 2, "max_digits": 2}}
    config = CurriculumConfig(enabled=True, attributes=["num_terms"], max_level=4)
    levels = levels_of(args, config, seed=0)
    assert levels.top == 4
    assert levels.configs(4)[0].config == {
        "min_digits": 2,
        "max_digits": 2,
        "min_terms": 2,
        "max_terms": 6,
    }


def test_a_row_is_a_function_of_level_and_position() -> None:
    import reasoning_gym

    levels = levels_of(SUMS, CurriculumConfig(enabled=True), seed=5)
    later = levels.row(2, 7)
    assert levels.row(0, 3) == levels_of(SUMS, CurriculumConfig(enabled=True), seed=5).row(0, 3)
    assert levels.row(2, 7) == later  # asked again, after another level: the same row
    made = reasoning_gym.create_dataset(
        "chain_sum", **levels.configs(2)[0].config, seed=split_seed("train", 5), size=8
    )
    assert later["reasoning_gym"]["entry"] == made[7]


def test_held_out_rows_are_the_top_levels() -> None:
    data = DataConfig(
        task="reasoning_gym",
        task_args=SUMS,
        curriculum=CurriculumConfig(enabled=True, max_level=2),
    )
    train = load_dataset_rows(data, 0)
    test = load_dataset_rows(data, 0, split="test")
    assert {r["reasoning_gym"]["config"]["max_terms"] for r in train} == {2}  # level 0
    assert {r["reasoning_gym"]["config"]["max_terms"] for r in test} == {4}  # level 2
    assert curriculum_of(data, 0).level == 0


@pytest.mark.parametrize(
    ("args", "settings", "said"),
    [
        ({"name": "acre"}, {}, "reasoning-gym has no curriculum for 'acre'"),
        (SUMS, {"attributes": ["num_term"]}, "no generator has 'num_term'"),
        (SUMS, {"max_level": 11}, "max_level 11: the last level is 10"),
        (SUMS, {"start_level": 3, "max_level": 3, "lower": 0.0}, "no level can move"),
        (SUMS, {"lower": 0.0, "upper": 1.0}, "no level can move"),
        (
            {"name": "chain_sum", "config": {"allow_negation": True}},
            {"attributes": ["num_terms"], "max_level": 1},
            None,
        ),
    ],
)
def test_curricula_that_cannot_run_are_one_line(
    args: dict, settings: dict, said: str | None
) -> None:
    config = CurriculumConfig(enabled=True, **settings)
    if said is None:
        assert levels_of(args, config, 0).top == 1
        return
    with pytest.raises(GymError) as err:
        levels_of(args, config, 0)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_curriculum_with_a_single_level_exits_2(capsys) -> None:
    # `ab` has one attribute with 4 levels; max_level 0 leaves one level, nothing can move
    data = DataConfig(
        task="reasoning_gym",
        task_args={"name": "ab", "size": 2},
        curriculum=CurriculumConfig(enabled=True, max_level=0),
    )
    with pytest.raises(DataError, match=r"data\.curriculum: no level can move"):
        load_dataset_rows(data, 0)


@pytest.mark.parametrize(
    ("tree", "said"),
    [
        ({"data": {"task": "arithmetic"}}, "data.curriculum needs data.task: reasoning_gym"),
        (
            {"rollout": {"max_staleness": 1}, "algorithm": {"tis_cap": 2.0}},
            "data.curriculum needs rollout.max_staleness: 0",
        ),
        ({"sampling": {"greso": True}}, "sampling.greso"),
        (
            {"data": {"curriculum": {"reward": "accuracy"}}},
            "data.curriculum.reward 'accuracy' is not one of the run's rewards (format, reasoning_gym)",
        ),
        ({"data": {"curriculum": {"lower": 0.5, "upper": 0.5}}}, "lower (0.5) must be below upper"),
        (
            {"data": {"curriculum": {"enabled": False, "window": 4}}},
            "data.curriculum.window is set but not used: set data.curriculum.enabled",
        ),
    ],
)
def test_config_refuses_a_curriculum_it_cannot_run(tree: dict, said: str) -> None:
    base = {"data": {"task": "reasoning_gym", "task_args": SUMS, "curriculum": {"enabled": True}}}
    data = {**base["data"], **tree.get("data", {})}
    data["curriculum"] = {
        **base["data"]["curriculum"],
        **tree.get("data", {}).get("curriculum", {}),
    }
    with pytest.raises((ConfigError, ValueError)) as err:
        build_config({**tree, "data": data})
    assert said in str(err.value)
