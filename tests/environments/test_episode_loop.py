"""The episode protocol through the turn loop: an environment written against
``grpo.environments`` alone (no tool syntax: every turn is an action) is started, stepped,
ended by ``done`` and closed by the same loop that runs the Python tool."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from echo_engine import EchoEngine

from grpo.config import RolloutConfig
from grpo.environments import Action, Step
from grpo.models import load_tokenizer
from grpo.rollout import render_prompt
from grpo.rollout.turns import EnvironmentLost, MultiTurnEngine


@dataclass
class CountEpisode:
    log: list[str]
    start_text: str | None
    steps: int = 0
    instance: object = "live"

    def start(self, row, seed):
        self.log.append(f"start {row['prompt']} {seed}")
        return self.start_text

    def step(self, action):
        self.steps += 1
        return Step(f"seen {action.call} {self.steps}", done=self.steps == 2)

    def reward(self):
        return float(self.steps)

    def close(self):
        self.log.append("close")


@dataclass
class CountEnvironment:
    """Every turn is an action; the episode is done at its second step."""

    start_text: str | None = None
    log: list[str] = field(default_factory=list)
    name: str = "count"
    tools: list = field(default_factory=list)
    stop: list = field(default_factory=list)
    has_reward: bool = True

    def action(self, text):
        return Action(text)

    def episode(self):
        return CountEpisode(self.log, self.start_text)


def _engine(tokenizer, environment, **config):
    config = RolloutConfig(max_new_tokens=100, max_turns=4, **config)
    render = lambda row: render_prompt(tokenizer, row["prompt"], None)  # noqa: E731
    return MultiTurnEngine(EchoEngine(tokenizer), tokenizer, config, environment, render)


def test_every_turn_is_stepped_until_the_episode_is_done(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    environment = CountEnvironment()
    engine = _engine(tokenizer, environment)
    rollout = engine.generate(["q"], [{"prompt": "q"}], 2, seeds=[5])
    # two turns each, both stepped; the second step's done ends the completion (not shown)
    assert [[(t["call"], t["output"]) for t in turns] for turns in rollout.turns] == [
        [("hi", "seen hi 1"), ("hi", "seen hi 2")]
    ] * 2
    assert rollout.answers == ["hi", "hi"]
    assert not rollout.truncated.any()
    assert environment.log == ["start q 5", "start q 5", "close", "close"]
    # the episode's reward (two steps), done, no failures, and the instance rewards receive
    assert [(r.reward, r.done, r.failures, r.instance) for r in rollout.episodes] == [
        (2.0, True, [], "live")
    ] * 2
    shown = engine.engine.contexts[-1]
    assert shown.endswith("<|tool|>seen hi 1<|end|><|assistant|>")


def test_start_text_joins_the_prompt_and_must_agree_within_a_group(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _engine(tokenizer, CountEnvironment(start_text=" Guess 1-10."))
    rollout = engine.generate(["q"], [{"prompt": "q"}], 2, seeds=[5])
    assert rollout.prompts == [render_prompt(tokenizer, "q Guess 1-10.", None)] * 2
    assert engine.engine.contexts[0] == rollout.prompts[0]

    class Drifting(CountEnvironment):  # each episode starts with its own number
        def episode(self):
            self.start_text = f"{len(self.tools)}"
            self.tools.append(None)
            return super().episode()

    environment = Drifting()
    with pytest.raises(EnvironmentLost, match="started with different texts"):
        _engine(tokenizer, environment).generate(["q"], [{"prompt": "q"}], 2, seeds=[5])
    assert environment.log.count("close") == 2  # closed all the same
