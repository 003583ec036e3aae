"""OpenEnv servers through the turn loop, against ``openenv-core``'s own server app on 127.0.0.1
(the hidden-number game of ``openenv_game``) and its own client: sessions, actions as text or
tool calls, rewards, and the failures a run must survive or stop on in one line."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from dataclasses import dataclass, field
from importlib.util import find_spec

import pytest
from echo_engine import EchoEngine

from grpo.config import ConfigError, RolloutConfig
from grpo.environments import Action, EnvironmentFailure, Step
from grpo.environments.openenv import OpenEnvEnvironment, parse_address, tool_call
from grpo.models import load_tokenizer
from grpo.rollout import render_prompt
from grpo.rollout.turns import MultiTurnEngine

# found, not imported: openenv-core brings gradio (seconds), paid only where these tests run
pytestmark = pytest.mark.skipif(
    find_spec("openenv") is None, reason="the envs extra (make test installs it)"
)

# random.Random(seed).randint(1, 10) for seeds 0 and 1: the game's hidden numbers
NUMBER = {0: 7, 1: 3}


def _loop(tokenizer, environment, script, **config):
    config = RolloutConfig(max_new_tokens=200, max_turns=5, **config)
    render = lambda row: render_prompt(tokenizer, row["prompt"], None)  # noqa: E731
    return MultiTurnEngine(EchoEngine(tokenizer, script), tokenizer, config, environment, render)


@pytest.fixture(scope="module")
def game():
    from openenv_game import game_app, serving

    with serving(game_app()) as url:
        yield url


def test_each_completion_plays_its_own_session_of_the_game(tiny_model_dir, game) -> None:
    from openenv_game import HiddenNumber

    tokenizer = load_tokenizer(tiny_model_dir)
    environment = OpenEnvEnvironment(f"openenv+{game}", timeout_s=10)
    assert (environment.field, environment.observation, environment.stop) == (
        "guess",
        "message",
        [],
    )
    HiddenNumber.closed.clear()
    # seed 0 hides 7: "5" -> higher, "x" -> not a number, "7" -> right (done)
    engine = _loop(tokenizer, environment, ["5", "x", "7"])
    rows = [{"prompt": "q", "hint": "odd"}]
    rollout = engine.generate(["q"], rows, 2, seeds=[0])
    # the reset's observation joins the prompt; the row's columns reached reset(**row)
    assert (
        rollout.prompts == [render_prompt(tokenizer, "qGuess my number, 1 to 10 (odd).", None)] * 2
    )
    assert [[(t["call"], t["output"]) for t in turns] for turns in rollout.turns] == [
        [("5", "higher"), ("x", "That is not a number."), ("7", "right")]
    ] * 2
    assert "<|tool|>higher<|end|>" in engine.engine.contexts[-1]
    # two sessions, each closed by the server when the loop closed it
    deadline = time.monotonic() + 5
    while len(HiddenNumber.closed) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert HiddenNumber.closed == ["seed-0", "seed-0"]


@pytest.mark.parametrize(("mode", "expected"), [("sum", 0.0 - 1.0 + 1.0), ("last", 1.0)])
def test_step_rewards_sum_or_last(game, mode, expected) -> None:
    environment = OpenEnvEnvironment(f"openenv+{game}?reward={mode}", timeout_s=10)
    episode = environment.episode()
    assert episode.start({"prompt": "q"}, 1) == "Guess my number, 1 to 10."
    assert episode.reward() is None  # no step yet, no reward
    steps = [episode.step(Action(guess)) for guess in ("5", "no", str(NUMBER[1]))]
    episode.close()
    assert steps == [Step("lower"), Step("That is not a number."), Step("right", done=True)]
    assert episode.reward() == expected


def test_a_failing_step_is_an_error_observation(game) -> None:
    episode = OpenEnvEnvironment(f"openenv+{game}", timeout_s=10).episode()
    episode.start({"prompt": "q"}, 0)
    step = episode.step(Action("boom"))
    episode.close()
    assert step.error == "the game broke (code: EXECUTION_ERROR)"
    assert step.observation == f"Error: {step.error}" and not step.done


def test_tool_calls_map_onto_the_action_fields(game) -> None:
    environment = OpenEnvEnvironment(f"openenv+{game}?action=tool", timeout_s=10)
    (schema,) = environment.tools
    assert schema["function"]["name"] == "HiddenNumber"
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"guess": {"title": "Guess", "type": "string"}},
        "required": ["guess"],
    }
    assert environment.stop == ["</tool_call>"]
    call = '<tool_call>{"name": "HiddenNumber", "arguments": {"guess": "7"}}</tool_call>'
    action = environment.action(f"I think 7.\n{call}\n")
    assert action == Action({"name": "HiddenNumber", "arguments": {"guess": "7"}})
    assert environment.action("It is 7.") is None  # an answer: no step
    episode = environment.episode()
    episode.start({"prompt": "q"}, 0)
    assert episode.step(action) == Step("right", done=True)
    episode.close()


def test_bad_tool_calls_are_errors_the_model_sees() -> None:
    assert tool_call('<tool_call>{"name": "other", "arguments": {}}</tool_call>', "G").error == (
        "unknown tool 'other' (tools: G)"
    )
    assert tool_call("<tool_call>{not json</tool_call>", "G").error == (
        'a tool call is {"name": "G", "arguments": {...}}'
    )


def test_an_absent_server_is_one_line_at_start() -> None:
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: nothing answers
        with pytest.raises(
            ConfigError, match=rf"no OpenEnv server answers at http://127.0.0.1:{port} "
        ):
            OpenEnvEnvironment(f"openenv+http://127.0.0.1:{port}", timeout_s=2)


class NotOpenEnv(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"ok": true}' if self.path == "/health" else b"nothing here"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_is_not_openenv_is_one_line_at_start() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotOpenEnv)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ConfigError, match=f"{url} answers, but not as an OpenEnv server"):
            OpenEnvEnvironment(f"openenv+{url}", timeout_s=2)
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("openenv+ftp://h:1", "is not openenv\\+http://HOST:PORT"),
        ("openenv+http://h:1?actoin=tool", "unknown option 'actoin'"),
        ("openenv+http://h:1?reward=mean", "reward=mean .* \\(one of: sum, last\\)"),
    ],
)
def test_bad_addresses_are_one_line(spec, said) -> None:
    with pytest.raises(ConfigError, match=f"rollout.environment: .*{said}"):
        parse_address(spec)


def test_fields_the_server_lacks_are_one_line(game) -> None:
    with pytest.raises(ConfigError, match=r"field=answer: .* has the fields guess"):
        OpenEnvEnvironment(f"openenv+{game}?field=answer", timeout_s=5)
    with pytest.raises(ConfigError, match=r"observation=text: .* has the fields message"):
        OpenEnvEnvironment(f"openenv+{game}?observation=text", timeout_s=5)


def test_a_slow_server_fails_the_step_in_one_line_within_the_timeout() -> None:
    from openenv_game import HiddenNumber, game_app, serving

    class SlowNumber(HiddenNumber):
        def step(self, action, timeout_s=None, **kwargs):
            time.sleep(3)
            return super().step(action)

    with serving(game_app(SlowNumber)) as url:
        episode = OpenEnvEnvironment(f"openenv+{url}", timeout_s=0.5).episode()
        episode.start({"prompt": "q"}, 0)
        t0 = time.monotonic()
        # the session gives up at 0.9 x the limit, before the loop would abandon the call
        said = rf"^openenv {url}: no answer to a step in 0.45 s \(rollout.environment_timeout_s: 0.5\)$"
        with pytest.raises(EnvironmentFailure, match=said):
            episode.step(Action("5"))
        assert time.monotonic() - t0 < 1
        with pytest.raises(EnvironmentFailure, match=said):  # the session is not used again
            episode.step(Action("6"))
        episode.close()  # a lost session is left to the server: no wait for the slow step


def test_a_server_gone_mid_episode_fails_in_one_line() -> None:
    from openenv_game import game_app, serving

    with serving(game_app()) as url:
        environment = OpenEnvEnvironment(f"openenv+{url}", timeout_s=2)
        episode = environment.episode()
        episode.start({"prompt": "q"}, 0)
    with pytest.raises(EnvironmentFailure, match=rf"^openenv {url}: .*failed"):
        episode.step(Action("5"))
    episode.close()  # after a lost connection: nothing left to close, no error


def test_too_few_sessions_on_the_server_fail_after_bounded_retries() -> None:
    from openenv_game import game_app, serving

    with serving(game_app(sessions=1)) as url:
        environment = OpenEnvEnvironment(f"openenv+{url}", timeout_s=2)
        first, second = environment.episode(), environment.episode()
        first.start({"prompt": "q"}, 0)
        with pytest.raises(
            EnvironmentFailure,
            match=r"no session after 3 attempts .*; the server answers but refuses sessions",
        ):
            second.start({"prompt": "q"}, 0)
        first.close()


# ------------------------------------------------------------------- an environment served


@dataclass
class CountEpisode:
    steps: int = 0
    seed: int | None = None
    instance: None = None

    def start(self, row, seed):
        self.seed = seed
        return f"Count to {row['target']} (row seed {row['seed']})."

    def step(self, action):
        self.steps += 1
        return Step(f"{self.steps} of {action.call['n']}", done=self.steps == 2)

    def reward(self):
        return float(self.steps * 10 + self.seed)

    def close(self):
        pass


@dataclass
class CountEnvironment:
    """Its actions are "count N" turns; its own parser and reward."""

    name: str = "count"
    tools: list = field(default_factory=list)
    stop: list = field(default_factory=lambda: ["!"])
    has_reward: bool = True

    def action(self, text):
        if not text.startswith("count"):
            return None
        word = text.split()[-1].rstrip("!")
        return Action({"n": word}) if word.isdigit() else Action(None, f"not a count: {word}")

    def episode(self):
        return CountEpisode()


def test_a_served_environment_plays_as_it_does_in_process(tiny_model_dir) -> None:
    from openenv_game import serving

    from grpo.environments.openenv_serve import app_for

    tokenizer = load_tokenizer(tiny_model_dir)
    script = ["count x!", "count 1!", "count 2!", "done"]
    rows = [{"prompt": "q", "target": 2, "seed": 9}]  # a column called seed reaches start too

    def play(environment):
        engine = _loop(tokenizer, environment, script)
        rollout = engine.generate(["q"], rows, 2, seeds=[4])
        episode = environment.episode()
        episode.start(rows[0], 4)
        for turn in rollout.turns[0]:
            if turn["error"] is None:  # as the loop: an action with an error is not stepped
                episode.step(Action(turn["call"]))
        reward = episode.reward()
        episode.close()
        return rollout, reward

    local, local_reward = play(CountEnvironment())
    with serving(app_for(CountEnvironment(), sessions=8)) as url:
        environment = OpenEnvEnvironment(f"openenv+{url}", timeout_s=10)
        assert (environment.tools, environment.stop) == ([], ["!"])
        served, served_reward = play(environment)
    assert served.prompts == local.prompts
    assert "Count to 2 (row seed 9)." in served.prompts[0]
    assert served.turns == [
        [{**t, "time_s": s["time_s"]} for t, s in zip(turns, served_turns, strict=True)]
        for turns, served_turns in zip(local.turns, served.turns, strict=True)
    ]
    assert [t["error"] for t in served.turns[0]] == ["not a count: x", None, None]
    assert (served.completion_ids == local.completion_ids).all()
    assert served_reward == local_reward == 2 * 10 + 4
