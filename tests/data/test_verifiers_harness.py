"""A verifiers harness (``vf_harness``) drives episodes of a verifiers taskset (``vf_tasks``)
through verifiers' own Agent and interception server, its model calls answered by the turn
loop's sampled turns through the policy's loopback endpoint."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import pytest
from echo_engine import EchoEngine

from grpo.config import ConfigError, RolloutConfig
from grpo.data.verifiers import taskset_rows
from grpo.environments.verifiers import KEY_VAR, VerifiersEnvironment
from grpo.models import load_tokenizer
from grpo.rollout import render_prompt
from grpo.rollout.turns import MultiTurnEngine

# found, not imported: verifiers takes seconds to import, paid only where these tests run
pytestmark = pytest.mark.skipif(
    find_spec("verifiers") is None, reason="the envs extra (make test installs it)"
)

SPEC = f"{Path(__file__).parent / 'vf_tasks.py'}:load_taskset"


def _play(tokenizer, environment):
    rows = taskset_rows(taskset=SPEC)[1:2]  # "What is 2 + 2?"
    prompts = [render_prompt(tokenizer, row["prompt"], None) for row in rows]
    engine = MultiTurnEngine(
        EchoEngine(tokenizer, ["5", "4"]),
        tokenizer,
        RolloutConfig(max_new_tokens=100, max_turns=5),
        environment,
    )
    return engine, engine.generate(prompts, rows, 2, seeds=[3])


def test_a_harness_plays_its_episodes_through_the_turn_loop(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    environment = VerifiersEnvironment("verifiers+vf_harness", timeout_s=60)
    engine, rollout = _play(tokenizer, environment)
    # the harness asked twice: the second call's new message is the observation; then it ended
    assert [[(t["call"], t["output"]) for t in turns] for turns in rollout.turns] == [
        [("5", "Sure? Say it again."), ("4", "the harness ended")]
    ] * 2
    assert "<|tool|>Sure? Say it again.<|end|>" in engine.engine.contexts[-1]
    # verifiers scored its own trace: the last reply "4" is correct and short (1 + 0.5)
    assert [e.reward for e in rollout.episodes] == [1.5, 1.5]
    trace = rollout.episodes[0].instance
    assert [m.content for m in trace.messages] == [
        "Answer with a number.",
        "What is 2 + 2?",
        "5",
        "Sure? Say it again.",
        "4",
    ]
    # token in, token out: only the sampled tokens count in the loss
    sampled = rollout.sampled_mask[0][rollout.completion_mask[0].bool()]
    ids = rollout.completion_ids[0][rollout.completion_mask[0].bool()]
    model_tokens = tokenizer.decode(ids[sampled], skip_special_tokens=True)
    assert model_tokens == "54"


def test_the_policy_endpoint_needs_its_token() -> None:
    environment = VerifiersEnvironment("verifiers+vf_harness", timeout_s=5)
    body = json.dumps({"model": "x", "messages": []}).encode()
    request = urllib.request.Request(
        f"{environment.endpoint.url}/chat/completions",
        body,
        {"Content-Type": "application/json", "Authorization": "Bearer wrong"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401


def test_an_unknown_harness_is_one_line() -> None:
    with pytest.raises(
        ConfigError, match=r"rollout.environment: verifiers\+no_such_harness: no verifiers harness"
    ):
        VerifiersEnvironment("verifiers+no_such_harness", timeout_s=5)


def serving(threads: set[threading.Thread]) -> list[str]:
    """The names of the event-loop and server threads among ``threads``."""
    return [t.name for t in threads if t.is_alive() and "_forever" in t.name]


def test_a_run_trains_on_harness_driven_episodes(tiny_config) -> None:
    from grpo.training.trainer import train

    config = tiny_config(
        data={"task": "verifiers", "task_args": {"taskset": SPEC}},
        rollout={
            "environment": "verifiers+vf_harness",
            "max_new_tokens": 24,
            "max_turns": 3,
            # 2 s on an idle machine; the starts that once waited out 300 s were the descriptor
            # mix-up grpo.environments.event_loop guards against, not a slow machine
            "environment_timeout_s": 60,
        },
        rewards={"functions": [{"name": "environment"}, {"name": "verifiers:correct"}]},
    )
    before = set(threading.enumerate()), set(os.environ)
    run_dir = train(config)
    # the run's environment is closed with it: its loop, its endpoint and the endpoint's token
    assert not [k for k in set(os.environ) - before[1] if k.startswith(KEY_VAR)]
    deadline = time.monotonic() + 10
    while (left := serving(set(threading.enumerate()) - before[0])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "event" not in r)
    # the harness asks twice, so each completion is two turns (or one cut by the token budget)
    assert 1.0 <= row["env/turns"] <= 2.0 and row["env/errors"] == 0.0
    assert row["reward/environment/errors"] == 0.0 and row["reward/correct/errors"] == 0.0
    # the random model never answers a sum: verifiers' weighted reward is the "short" part only
    assert row["reward/correct/mean"] == 0.0
    assert 0.0 <= row["reward/environment/mean"] <= 0.5


def test_two_environments_keep_their_own_tokens(tiny_model_dir) -> None:
    first = VerifiersEnvironment("verifiers+vf_harness", timeout_s=60)
    VerifiersEnvironment("verifiers+vf_harness", timeout_s=60)  # a run may build it again
    _, rollout = _play(load_tokenizer(tiny_model_dir), first)
    assert [e.reward for e in rollout.episodes] == [1.5, 1.5]
