"""A verifiers taskset (``vf_tasks``, written against ``verifiers.v1``) as grpo's data and
rewards: its tasks are the prompts, its rewards score a trace of each completion through the
task's own ``score``, and a run logs each as ``reward/<name>``."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest

from grpo.config import RewardSpec
from grpo.data import DataError, get_task
from grpo.data.verifiers import taskset_rows
from grpo.rewards.registry import resolve_reward
from grpo.rewards.verifiers import reward_names, score
from grpo.training.trainer import train

# found, not imported: verifiers takes seconds to import, paid only where these tests run
pytestmark = pytest.mark.skipif(
    find_spec("verifiers") is None, reason="the envs extra (make test installs it)"
)

SPEC = f"{Path(__file__).parent / 'vf_tasks.py'}:load_taskset"


def test_tasks_become_rows_with_their_messages() -> None:
    rows = get_task("verifiers").rows("train", 0, taskset=SPEC)
    assert len(rows) == 4
    assert rows[1] == {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "What is 2 + 2?"},
        ],
        "verifiers_taskset": SPEC,
        "verifiers_task": 1,
    }
    assert reward_names(SPEC) == ["correct", "short"]


def test_the_tasks_own_rewards_score_a_trace_of_the_completion() -> None:
    assert score(SPEC, 1, " 4 ") == {"correct": 1.0, "short": 1.0}
    assert score(SPEC, 1, "It is 4, I think.") == {"correct": 0.0, "short": 0.0}
    # a multi-turn completion: its last turn is the trace's last reply
    turns = [{"text": "3?", "output": "no"}, {"text": "4", "output": None}]
    assert score(SPEC, 1, "4", turns) == {"correct": 1.0, "short": 1.0}


def test_rewards_by_name_and_their_weighted_sum() -> None:
    columns = {"verifiers_taskset": [SPEC] * 3, "verifiers_task": [0, 1, 2]}
    completions = ["2", "5", "a long answer: 6"]
    correct = resolve_reward(RewardSpec(name="verifiers:correct"))
    short = resolve_reward(RewardSpec(name="verifiers:short"))
    total = resolve_reward(RewardSpec(name="verifiers"))
    assert correct(completions, **columns) == [1.0, 0.0, 0.0]
    assert short(completions, **columns) == [1.0, 1.0, 0.0]
    # verifiers' own weights: correct 1, short 0.5
    assert total(completions, **columns) == [1.5, 0.5, 0.0]
    with pytest.raises(
        ValueError, match=r"verifiers:missing: .* gives no reward missing \(correct, short\)"
    ):
        resolve_reward(RewardSpec(name="verifiers:missing"))(completions, **columns)


def test_a_taskset_that_does_not_load_is_one_line(tmp_path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import nothing_here\nx = 3\n")
    said = r"verifiers taskset .*broken.py:x: importing .* failed \(ModuleNotFoundError"
    with pytest.raises(DataError, match=said):
        taskset_rows(taskset=f"{broken}:x")
    other = tmp_path / "other.py"
    other.write_text("x = 3\n")
    with pytest.raises(DataError, match=r"other.py:x: not a verifiers.v1.Taskset \(int\)"):
        taskset_rows(taskset=f"{other}:x")


def test_a_run_trains_on_a_taskset_and_logs_each_reward(tiny_config) -> None:
    config = tiny_config(
        data={"task": "verifiers", "task_args": {"taskset": SPEC}},
        rewards={"functions": [{"name": "verifiers:correct"}, {"name": "verifiers:short"}]},
    )
    run_dir = train(config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "event" not in r)
    assert row["reward/correct/errors"] == 0.0 and row["reward/short/errors"] == 0.0
    assert row["reward/correct/mean"] == 0.0  # the random model never answers the sum alone
    assert 0.0 <= row["reward/short/mean"] <= 1.0
    assert row["reward/mean"] == pytest.approx(row["reward/short/mean"])
