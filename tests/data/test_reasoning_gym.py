"""reasoning-gym as a task (``data.task: reasoning_gym``), against the installed package: rows by
split seed, the checks of names, config keys and ranges (one line each), a weighted mix, and
the ``reasoning_gym`` reward (the generator's own score_answer) in the reward workers."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from grpo.cli import main  # noqa: E402
from grpo.config import DataConfig, RewardsConfig, build_config  # noqa: E402
from grpo.data import DataError, load_dataset_rows  # noqa: E402
from grpo.data.reasoning_gym import (  # noqa: E402
    SEED_SPAN,
    SPLITS,
    reasoning_gym_rows,
    registry,
    split_seed,
)
from grpo.rewards import RewardRunner  # noqa: E402

ONE_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def sums(**args: object) -> DataConfig:
    task_args = {"name": "chain_sum", "config": ONE_DIGIT_SUMS, "size": 8, **args}
    return DataConfig(task="reasoning_gym", task_args=task_args)


def test_rows_are_the_packages_items_at_the_splits_seeds() -> None:
    rows = load_dataset_rows(sums(), seed=3)
    made = reasoning_gym.create_dataset(
        "chain_sum", **ONE_DIGIT_SUMS, seed=split_seed("train", 3), size=8
    )
    assert [r["prompt"] for r in rows] == [made[i]["question"] for i in range(8)]
    assert [r["answer"] for r in rows] == [made[i]["answer"] for i in range(8)]
    assert rows[0]["reasoning_gym"] == {
        "dataset": "chain_sum",
        "config": ONE_DIGIT_SUMS,
        "entry": made[0],
    }
    assert load_dataset_rows(sums(), seed=3) == rows  # seeded
    assert load_dataset_rows(sums(), seed=4) != rows


def test_splits_draw_from_disjoint_seed_ranges() -> None:
    # item i of a dataset seeded s is drawn from Random(s + i): ranges [base, base + SEED_SPAN)
    for seed in range(200):
        bases = sorted(split_seed(split, seed) for split in SPLITS)
        assert all(b - a >= SEED_SPAN for a, b in itertools.pairwise(bases)), seed
        assert bases[-1] + SEED_SPAN <= 2**32  # numpy takes seeds below 2**32
    train = load_dataset_rows(sums(), seed=0)
    test = load_dataset_rows(sums(), seed=0, split="test")
    assert [r["prompt"] for r in train] != [r["prompt"] for r in test]


@pytest.mark.parametrize(
    ("task_args", "said"),
    [
        (
            {"name": "chain_sun"},
            "reasoning_gym: no generator 'chain_sun'; closest: chain_sum, decimal_chain_sum",
        ),
        (
            {"name": "chain_sum", "config": {"max_term": 3}},
            "reasoning_gym 'chain_sum': no config key 'max_term' (did you mean 'max_terms'?)",
        ),
        (
            {"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}},
            "is out of range: max_terms must be >= min_terms",
        ),
        ({"name": "chain_sum", "config": {"seed": 1}}, "config.seed is set by grpo"),
        ({}, "set task_args.name (one generator) or task_args.datasets"),
        (
            {"datasets": [{"name": "chain_sum", "weight": 0}]},
            "task_args.datasets[0].weight must be > 0",
        ),
        ({"name": "chain_sum", "size": 0}, "task_args.size must be 1 to"),
    ],
)
def test_bad_task_args_are_one_line(task_args: dict, said: str) -> None:
    with pytest.raises(DataError) as err:
        load_dataset_rows(DataConfig(task="reasoning_gym", task_args=task_args), 0)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_bad_generator_name_exits_2_before_anything_is_written(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    code = main(
        [
            "train",
            f"model.name={tiny_model_dir}",
            "data.task=reasoning_gym",
            "data.task_args={name: chain_summ}",
            "rewards.functions=[{name: reasoning_gym}]",
            f"train.output_dir={tmp_path}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith(
        "grpo: error: reasoning_gym: no generator 'chain_summ'; closest: chain_sum"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_mix_draws_each_generator_by_weight() -> None:
    datasets = [
        {"name": "chain_sum", "weight": 3, "config": ONE_DIGIT_SUMS},
        {"name": "basic_arithmetic", "weight": 1},
    ]
    rows = reasoning_gym_rows("train", 0, size=400, datasets=datasets)
    names = [r["reasoning_gym"]["dataset"] for r in rows]
    # reasoning-gym's CompositeDataset picks 3:1; 400 draws: 300 expected, sd ~8.7
    assert 260 <= names.count("chain_sum") <= 340
    assert {
        r["reasoning_gym"]["config"] == ONE_DIGIT_SUMS
        for r in rows
        if r["reasoning_gym"]["dataset"] == "chain_sum"
    } == {True}


def test_rows_without_an_oracle_answer_are_kept() -> None:
    # graph_color's answers are checked by rule: answer None, never skipped as ungradable
    rows = load_dataset_rows(
        DataConfig(task="reasoning_gym", task_args={"name": "graph_color", "size": 4}), 0
    )
    assert len(rows) == 4 and rows.skipped == 0
    assert all(r["answer"] is None for r in rows)


def test_the_reward_is_score_answer_on_the_answer_tag() -> None:
    row = load_dataset_rows(sums(), seed=0)[0]
    gold = row["answer"]
    completions = [
        f"<think>add</think><answer>{gold}</answer>",  # 1
        "<think>add</think><answer>99</answer>",  # 0: wrong
        f"<think>the sum is {gold}</think>",  # 0 strictly: no <answer>
    ]
    columns = {key: [value] * 3 for key, value in row.items()}
    strict = RewardsConfig(functions=[{"name": "reasoning_gym"}])
    lenient = RewardsConfig(functions=[{"name": "reasoning_gym", "args": {"last_number": True}}])
    for config, expected in ((strict, [1.0, 0.0, 0.0]), (lenient, [1.0, 0.0, 1.0])):
        runner = RewardRunner(config)
        try:
            out = runner(completions, ["p"] * 3, columns, [[1]] * 3)
        finally:
            runner.close()
        assert out.per_function[:, 0].tolist() == expected
        assert out.errors == {"reasoning_gym": 0}
        assert runner.pool is not None  # it ran in the worker processes


def test_a_verifier_that_raises_is_a_counted_reward_error(capsys) -> None:
    row = load_dataset_rows(sums(), seed=0)[0]
    broken = {**row["reasoning_gym"], "entry": {"question": row["prompt"]}}  # no oracle answer
    columns = {"reasoning_gym": [row["reasoning_gym"], broken]}
    runner = RewardRunner(RewardsConfig(functions=[{"name": "reasoning_gym"}], fallback=-1.0))
    try:
        gold = f"<answer>{row['answer']}</answer>"
        out = runner([gold, gold], ["p"] * 2, columns, [[1]] * 2)
    finally:
        runner.close()
    assert out.per_function[:, 0].tolist() == [1.0, -1.0]
    assert out.errors == {"reasoning_gym": 1}
    assert "KeyError: 'answer'" in capsys.readouterr().err


def test_a_verifier_value_that_is_no_number_is_refused(monkeypatch) -> None:
    from grpo.rewards import reasoning_gym as reward
    from grpo.rewards._reward_worker import check_values

    row = load_dataset_rows(sums(), seed=0)[0]
    monkeypatch.setattr(reward, "score", lambda answer, row: "1.0")
    values = reward.reasoning_gym_reward()(
        ["<answer>1</answer>"], reasoning_gym=[row["reasoning_gym"]]
    )
    # the worker checks what the function returns: a string is a malformed value, counted
    with pytest.raises(
        ValueError, match=r"reward 'reasoning_gym' returned a str '1\.0' at position 0"
    ):
        check_values("reasoning_gym", values, 1)


def test_the_tasks_defaults_pay_format_and_score_answer() -> None:
    config = build_config({"data": {"task": "reasoning_gym", "task_args": {"name": "chain_sum"}}})
    assert [spec.name for spec in config.rewards.functions] == ["format", "reasoning_gym"]


def test_grpo_tasks_lists_the_generators(capsys) -> None:
    assert main(["tasks", "reasoning_gym"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(registry())
    chain = next(line for line in lines if line.startswith("chain_sum "))
    assert "config: min_terms, max_terms, min_digits, max_digits, allow_negation" in chain
    assert "curriculum levels: num_terms (11), num_digits (10)" in chain
    assert main(["tasks"]) == 0
    assert "list: grpo tasks reasoning_gym" in capsys.readouterr().out


@pytest.mark.slow
def test_every_generators_rows_travel_and_score_their_own_answer() -> None:
    # the rows cross process boundaries (reward workers, the producer process): every entry
    # pickles and is JSON text; the reward pays each generator's oracle answer 1
    runner = RewardRunner(RewardsConfig(functions=[{"name": "reasoning_gym"}], timeout_s=120))
    try:
        for name in sorted(registry()):
            rows = reasoning_gym_rows("train", 0, size=2, name=name)
            for row in rows:
                assert pickle.loads(pickle.dumps(row)) == row, name
                json.dumps(row)
            graded = [r for r in rows if r["answer"] is not None]
            if not graded:
                continue
            completions = [f"<answer>{r['answer']}</answer>" for r in graded]
            columns = {"reasoning_gym": [r["reasoning_gym"] for r in graded]}
            out = runner(completions, ["p"] * len(graded), columns, [[1]] * len(graded))
            assert out.errors == {"reasoning_gym": 0}, name
            assert out.per_function[:, 0].tolist() == [1.0] * len(graded), name
    finally:
        runner.close()


def test_maj_at_k_votes_by_the_verifiers_own_extraction() -> None:
    from grpo.eval import answer_strategies

    lenient = RewardsConfig(functions=[{"name": "reasoning_gym", "args": {"last_number": True}}])
    runner = RewardRunner(lenient)
    try:
        assert answer_strategies(runner) == ("answer", "last_number")
    finally:
        runner.close()
