"""Training runs that play an environment class: from a recipe (``rollout.environment``) and
from the library (``grpo.train(environment=...)``), with its reward combined with others, its
instances handed to a TRL-style reward, reproducible from the seed, and stopped in one line when
the environment keeps failing."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import trl_envs
from metric_glossary import documented_metrics

import grpo
from grpo.config import ConfigError
from grpo.rewards import RewardFailure
from grpo.training.trainer import train

HERE = Path(__file__).parent
ENV = f"{HERE / 'trl_envs.py'}:GuessNumber"
# TRL's reward signature: the environments column holds the episode's live instances
TRL_REWARD = (
    "def guessed(completions, environments, **kwargs):\n"
    "    return [float(len(e.guesses)) + 0.1 * e.target for e in environments]\n"
)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "event" not in row]


def _config(tiny_config, tmp_path: Path, environment: str = ENV, **sections):
    reward = tmp_path / "trl_reward.py"
    reward.parent.mkdir(exist_ok=True)
    reward.write_text(TRL_REWARD)
    functions = [
        {"name": "environment"},
        {"name": f"{reward}:guessed", "weight": 0.5},
        {"name": "format"},
    ]
    return tiny_config(
        rollout={"environment": environment, "max_new_tokens": 16, "max_turns": 3},
        rewards={"functions": functions, **sections.pop("rewards", {})},
        **sections,
    )


def test_a_recipe_trains_on_an_environment_class_and_repeats_with_its_seed(
    tiny_config, tmp_path: Path
) -> None:
    first = _metrics(train(_config(tiny_config, tmp_path / "a", train={"run_name": "a"})))
    again = _metrics(train(_config(tiny_config, tmp_path / "b", train={"run_name": "b"})))
    timed = ("time/", "env/time_s", "tokens_per_s", "rollout/tokens_per_s")
    untimed = [{k: v for k, v in row.items() if not k.startswith(timed)} for row in first]
    assert untimed == [{k: v for k, v in row.items() if not k.startswith(timed)} for row in again]
    row = first[0]
    # the random model writes no call: one turn each, nothing done, no errors
    assert row["env/turns"] == 1.0 and row["env/errors"] == 0.0 and row["env/done_frac"] == 0.0
    assert row["reward/environment/mean"] == 0.0  # no guess, no win
    # the TRL-style reward read the live instances: no guesses, 0.1 * the hidden number
    assert 0.1 <= row["reward/guessed/mean"] <= 0.8 and row["reward/guessed/errors"] == 0.0
    env_keys = {k for k in row if k.startswith("env/")} | {"time/env_s"}
    assert env_keys == {
        "env/turns",
        "env/errors",
        "env/failed_frac",
        "env/done_frac",
        "env/time_s",
        "time/env_s",
    }
    assert env_keys <= documented_metrics()


def test_the_library_takes_the_class_itself(tiny_config, tmp_path: Path) -> None:
    config = _config(tiny_config, tmp_path, environment=None, train={"steps": 1})
    run_dir = grpo.train(config, environment=trl_envs.Counter)
    saved = (run_dir / "config.yaml").read_text()
    assert "environment: trl_envs:Counter" in saved  # recorded by module and name
    assert _metrics(run_dir)[0]["reward/environment/mean"] == 0.0  # nothing incremented


def test_the_library_takes_a_factory_and_resume_sees_what_it_binds(tiny_config, tmp_path) -> None:
    # TRL's environment_factory may be a partial; the run records its class, and a resume with
    # other bound arguments is another environment
    config = _config(tiny_config, tmp_path, environment=None, train={"steps": 1, "save_every": 1})
    run_dir = grpo.train(config, environment=functools.partial(trl_envs.Levelled, level=2))
    assert "environment: trl_envs:Levelled" in (run_dir / "config.yaml").read_text()
    assert _metrics(run_dir)[0]["reward/environment/mean"] == 2.0  # level 2 x (0 + 1)
    longer = config.model_copy(update={"train": config.train.model_copy(update={"steps": 2})})
    with pytest.raises(ConfigError, match="the environment class's source"):
        grpo.train(longer, environment=functools.partial(trl_envs.Levelled, level=3))
    run_dir = grpo.train(longer, environment=functools.partial(trl_envs.Levelled, level=2))
    assert [row["step"] for row in _metrics(run_dir)] == [1, 2]


def test_a_nan_reward_is_this_rewards_counted_error(tiny_config, tmp_path: Path) -> None:
    config = _config(tiny_config, tmp_path, f"{HERE / 'trl_envs.py'}:NaNReward", train={"steps": 1})
    row = _metrics(train(config))[0]
    assert row["reward/environment/errors"] == 8.0  # every completion, scored the fallback
    assert row["reward/environment/mean"] == 0.0


def test_an_environment_that_keeps_failing_stops_the_run(tiny_config, tmp_path: Path) -> None:
    config = _config(
        tiny_config,
        tmp_path,
        f"{HERE / 'trl_envs.py'}:RaisingReward",
        rewards={"functions": [{"name": "format"}], "error_patience": 1},
    )
    with pytest.raises(RewardFailure) as stopped:
        train(config)
    assert str(stopped.value) == (
        f"environment '{HERE / 'trl_envs.py'}:RaisingReward' failed on more than "
        "rewards.max_error_frac=0.5 of the completions for 1 steps in a row (step 1: 8/8); its "
        "first error is printed above"
    )


def test_resume_refuses_an_environment_class_whose_source_changed(
    tiny_config, tmp_path: Path
) -> None:
    # the library's class is recorded by module and name: its code is what can change under it
    config = _config(tiny_config, tmp_path, environment=None, train={"steps": 1, "save_every": 1})
    grpo.train(config, environment=trl_envs.Counter)

    class Counter(trl_envs.Counter):  # same name, another reward
        def get_reward(self) -> float:
            return 2.0 * self.count

    Counter.__module__ = trl_envs.Counter.__module__
    longer = config.model_copy(update={"train": config.train.model_copy(update={"steps": 2})})
    with pytest.raises(ConfigError, match="the environment class's source"):
        grpo.train(longer, environment=Counter)
    run_dir = grpo.train(longer, environment=trl_envs.Counter)  # the same class resumes
    assert [row["step"] for row in _metrics(run_dir)] == [1, 2]
