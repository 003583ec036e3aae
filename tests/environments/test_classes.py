"""Environment classes written to TRL's contract (trl_envs.py imports nothing of grpo), run
through the turn loop: tools from documented public methods, calls in the fence and template
syntaxes, seeded resets, rewards, and what a bad class or a bad call becomes."""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path

import pytest
import trl_envs
from echo_engine import EchoEngine
from transformers.utils import get_json_schema

from grpo.config import ConfigError, RolloutConfig
from grpo.environments import Action
from grpo.environments.classes import SEEDED, ClassEnvironment, load_class, seeded
from grpo.models import load_tokenizer
from grpo.rollout import render_prompt
from grpo.rollout.turns import EnvironmentLost, MultiTurnEngine, env_metrics

HERE = Path(__file__).parent
GUESS = "```\nguess({})\n```\n"


def _engine(tokenizer, cls, replies, **config):
    config = RolloutConfig(
        **{"max_new_tokens": 200, "max_turns": 4, "environment_timeout_s": 5.0, **config}
    )
    render = lambda row: render_prompt(tokenizer, row["prompt"], None)  # noqa: E731
    environment = ClassEnvironment(cls, config.tool_call_format, config.tool_max_output_chars)
    return MultiTurnEngine(EchoEngine(tokenizer, replies), tokenizer, config, environment, render)


def test_documented_public_methods_are_the_tools_with_transformers_schemas() -> None:
    fence = ClassEnvironment(trl_envs.GuessNumber)
    # reset and get_reward are the trainer's; _helper is private; peek has no docstring
    assert list(fence.signatures) == ["guess"]
    assert fence.tools == [] and fence.stop == ["\n```\n"] and fence.has_reward
    template = ClassEnvironment(trl_envs.GuessNumber, "template")
    assert template.tools == [get_json_schema(trl_envs.GuessNumber().guess)]
    assert template.tools[0]["function"]["parameters"]["properties"]["n"]["type"] == "integer"
    assert list(ClassEnvironment(trl_envs.Counter).signatures) == ["increment"]


def test_calls_in_both_syntaxes_become_actions_and_bad_ones_errors() -> None:
    fence = ClassEnvironment(trl_envs.GuessNumber)
    call = {"name": "guess", "arguments": {"n": 3}}
    assert fence.action("I try 3.\n```\nguess(3)\n```\n") == Action(call)
    assert fence.action("```python\nguess(n=3)\n```") == Action(call)
    assert fence.action("It is 3.") is None  # an answer: the episode ends
    assert fence.action("```\nguess(3)\n``` and then") is None  # the block does not end the turn
    assert fence.action("```\nshout(3)\n```") == Action(None, "unknown tool 'shout' (tools: guess)")
    assert fence.action("```\nguess(1, 2)\n```") == Action(
        None, "bad arguments for guess: too many positional arguments"
    )
    assert fence.action("```\nguess(x)\n```").error.startswith("a call is one tool")
    template = ClassEnvironment(trl_envs.GuessNumber, "template")
    json_call = '<tool_call>{"name": "guess", "arguments": {"n": 3}}</tool_call>'
    assert template.action(json_call + "\n") == Action(call)
    assert template.action("<tool_call>{oops}</tool_call>").error.startswith("a tool call is")
    assert template.action(json_call.replace('"n"', '"m"')).error.startswith("bad arguments")


def test_an_episode_plays_the_class_and_the_group_shares_its_number(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    replies = [GUESS.format(n) for n in (2, 5, 7)] + ["done"]
    engine = _engine(tokenizer, trl_envs.GuessNumber, replies)
    rollout = engine.generate(["q"] * 2, [{"prompt": "q", "level": 1}] * 2, 3, seeds=[11, 12])
    # reset's text joins the prompt as TRL joins it (appended as it is)
    assert rollout.prompts[0] == render_prompt(tokenizer, "q Guess my number (1-8).", None)
    envs = [e.instance for e in rollout.episodes]
    assert envs[0].row == {"prompt": "q", "level": 1}  # reset(**row) got every column
    # the reset ran under the prompt's seed: the group shares its number, as seeding does
    for seed, group in ((11, envs[:3]), (12, envs[3:])):
        with seeded(seed):
            expected = random.randint(1, 8)
        assert [e.target for e in group] == [expected] * 3
    turns = rollout.turns[0]
    assert [t["call"] for t in turns] == [
        {"name": "guess", "arguments": {"n": n}} for n in (2, 5, 7)
    ] + [None]
    answers = [
        "correct" if n == envs[0].target else "higher" if n < envs[0].target else "lower"
        for n in (2, 5, 7)
    ]
    assert [t["output"] for t in turns[:3]] == answers
    assert [e.reward for e in rollout.episodes] == [float(e.target in (2, 5, 7)) for e in envs]
    metrics = env_metrics(rollout.turns, rollout.episodes)
    assert metrics["env/turns"] == 4.0 and metrics["env/errors"] == 0.0
    assert metrics["env/done_frac"] == 0.0 and metrics["env/time_s"] > 0


def test_the_runs_generators_are_left_as_they_were(tiny_model_dir) -> None:
    import torch

    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _engine(tokenizer, trl_envs.GuessNumber, "done")
    random.seed(3)
    torch.manual_seed(3)
    engine.generate(["q"], [{"prompt": "q"}], 2, seeds=[5])
    after = random.random(), torch.rand(1).item()
    random.seed(3)
    torch.manual_seed(3)
    assert (random.random(), torch.rand(1).item()) == after


def test_a_tool_that_raises_or_returns_a_number_answers_the_model(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout = _engine(tokenizer, trl_envs.RaisingTool, [GUESS.format(3), "done"]).generate(
        ["q"], [{"prompt": "q"}], 1, seeds=[0]
    )
    turn = rollout.turns[0][0]
    assert turn["error"] == "ValueError: cannot guess 3" and turn["output"] == ""
    assert rollout.episodes[0].failures == []  # the tool's own error, not the environment's
    assert env_metrics(rollout.turns, rollout.episodes)["env/errors"] == 1.0
    counter = "```\nincrement(4)\n```\n"
    rollout = _engine(tokenizer, trl_envs.Counter, [counter, "done"]).generate(
        ["q"], [{"prompt": "q"}], 1, seeds=[0]
    )
    assert rollout.turns[0][0]["output"] == "4" and rollout.episodes[0].reward == 4.0
    assert rollout.prompts == ["q"]  # reset returned None: the prompt as it came


def test_unknown_tools_and_bad_arguments_are_shown_and_counted(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    bad = ["```\nshout(3)\n```\n", "```\nguess(n=1, m=2)\n```\n", "done"]
    engine = _engine(tokenizer, trl_envs.GuessNumber, bad)
    rollout = engine.generate(["q"], [{"prompt": "q"}], 1, seeds=[0])
    errors = [t["error"] for t in rollout.turns[0]]
    assert errors == [
        "unknown tool 'shout' (tools: guess)",
        "bad arguments for guess: got an unexpected keyword argument 'm'",
        None,
    ]
    assert "<|tool|>Error: unknown tool 'shout' (tools: guess)<|end|>" in engine.engine.contexts[1]
    assert rollout.episodes[0].instance.guesses == []  # neither call reached the instance
    assert env_metrics(rollout.turns, rollout.episodes)["env/errors"] == 2.0


def test_a_hanging_tool_is_cut_at_the_timeout_and_ends_its_completion(
    tiny_model_dir, capsys
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _engine(tokenizer, trl_envs.HangingTool, GUESS.format(3), environment_timeout_s=0.5)
    t0 = time.perf_counter()
    rollout = engine.generate(["q"], [{"prompt": "q"}], 2, seeds=[0])
    assert time.perf_counter() - t0 < 5  # both calls ran at once, each cut at 0.5 s
    assert [len(t) for t in rollout.turns] == [1, 1]
    assert rollout.turns[0][0]["error"] == "timed out after 0.5 s"
    assert rollout.episodes[0].failures == ["step: timed out after 0.5 s"]
    metrics = env_metrics(rollout.turns, rollout.episodes)
    assert metrics["env/failed_frac"] == 1.0 and metrics["env/errors"] == 2.0
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "environment HangingTool: step failed (timed out after 0.5 s); the first such failure, "
        "later ones are counted in env/errors"
    ]


def test_a_failing_reward_is_counted_and_close_is_called(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout = _engine(tokenizer, trl_envs.RaisingReward, "done").generate(
        ["q"], [{"prompt": "q"}], 2, seeds=[0]
    )
    assert [e.reward for e in rollout.episodes] == [None, None]
    assert rollout.episodes[0].failures == ["reward: RuntimeError: no score"]
    assert env_metrics(rollout.turns, rollout.episodes)["env/errors"] == 2.0
    before = trl_envs.Closing.closed
    _engine(tokenizer, trl_envs.Closing, "done").generate(["q"], [{"prompt": "q"}], 3, seeds=[0])
    assert trl_envs.Closing.closed == before + 3  # each episode; the probe had none


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        (
            trl_envs.RaisingReset,
            "environment RaisingReset: start failed on the row 'q' (KeyError: 'level')",
        ),
        (
            trl_envs.NumberReset,
            "environment NumberReset: start failed on the row 'q' (TypeError: reset returned int, "
            "expected a "
            "string or None)",
        ),
        (
            trl_envs.UnseededReset,
            "environment UnseededReset: the episodes of one prompt started with different texts "
            "(a group must face one problem: seed the episode from the seed start() receives)",
        ),
    ],
)
def test_a_reset_that_fails_stops_the_run_in_one_line(tiny_model_dir, cls, said) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(EnvironmentLost) as lost:
        _engine(tokenizer, cls, "done").generate(["q"], [{"prompt": "q"}], 2, seeds=[0])
    assert str(lost.value) == said


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (
            "nowhere/env.py:Guess",
            "rollout.environment=nowhere/env.py:Guess: file nowhere/env.py not found",
        ),
        (
            "no_such_module:Guess",
            "rollout.environment=no_such_module:Guess: cannot import no_such_module (ModuleNotFoundError: No module named 'no_such_module')",
        ),
        ("trl_envs:Missing", "rollout.environment=trl_envs:Missing: trl_envs has no class Missing"),
        (
            "trl_envs:math",
            "rollout.environment=trl_envs:math: math is a module, not a class or a function that "
            "makes an instance",
        ),
        (
            "trl_envs",
            "rollout.environment=trl_envs: expected path/to/file.py:ClassName or module:ClassName",
        ),
    ],
)
def test_a_class_that_does_not_load_is_one_line(spec, said) -> None:
    with pytest.raises(ConfigError) as raised:
        load_class(spec)
    assert str(raised.value) == said


def test_a_file_path_loads_and_a_broken_file_is_one_line(tmp_path) -> None:
    assert load_class(f"{HERE / 'trl_envs.py'}:Counter").__name__ == "Counter"
    broken = tmp_path / "broken.py"
    broken.write_text("import nothing_here\n")
    with pytest.raises(ConfigError) as raised:
        load_class(f"{broken}:Env")
    assert str(raised.value) == (
        f"rollout.environment={broken}:Env: importing {broken} failed "
        "(ModuleNotFoundError: No module named 'nothing_here')"
    )

    # a dataclass whose annotations are strings looks its module up in sys.modules
    dataclass_env = tmp_path / "dataclass_env.py"
    dataclass_env.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass, field\n\n"
        "@dataclass\nclass Tally:\n    seen: list[int] = field(default_factory=list)\n\n"
        "    def reset(self, **row):\n        self.seen = []\n\n"
        '    def note(self, n: int) -> int:\n        """Note a number.\n\n'
        '        Args:\n            n: the number\n        """\n'
        "        self.seen.append(n)\n        return len(self.seen)\n"
    )
    assert list(ClassEnvironment(load_class(f"{dataclass_env}:Tally")).signatures) == ["note"]


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        (
            trl_envs.NeedsArguments,
            "rollout.environment: NeedsArguments() failed (TypeError: NeedsArguments.__init__() "
            "missing 1 required positional argument: 'level'); an environment class (or "
            "factory) is called without arguments",
        ),
        (trl_envs.NoReset, "rollout.environment: NoReset has no reset method"),
        (
            trl_envs.UndocumentedArgument,
            "rollout.environment: UndocumentedArgument.hint: no tool schema "
            "(DocstringParsingException: Cannot generate JSON schema for hint because the "
            "docstring has no description for the argument 'k')",
        ),
    ],
)
def test_a_class_that_cannot_be_used_is_refused_at_start(cls, said) -> None:
    with pytest.raises(ConfigError) as raised:
        ClassEnvironment(cls)
    assert str(raised.value) == said


def test_a_class_is_probed_without_its_properties_or_a_close_before_reset(tiny_model_dir) -> None:
    # inspecting the tools evaluates no property, and the probe, never reset, is never closed
    environment = ClassEnvironment(trl_envs.ClosesWhatResetOpened)
    assert sorted(environment.signatures) == ["guess", "rules"]  # a static method is a tool
    tokenizer = load_tokenizer(tiny_model_dir)
    rules = "```\nrules()\n```\n"
    rollout = _engine(tokenizer, trl_envs.ClosesWhatResetOpened, [rules, "done"]).generate(
        ["q"], [{"prompt": "q"}], 2, seeds=[0]
    )
    assert rollout.turns[0][0]["output"] == "guess from 1 to 8"
    assert [e.failures for e in rollout.episodes] == [[], []]  # each close found its reset's log


def test_a_tool_whose_parameters_cannot_be_named_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        ClassEnvironment(trl_envs.VarArgs)
    assert str(refused.value) == (
        "rollout.environment: VarArgs.add: a tool's parameters are each named, with a type and a "
        "docstring line; not nums (*args)"
    )


def test_each_reset_has_the_whole_timeout_though_resets_take_turns(tiny_model_dir) -> None:
    # 4 resets of 0.4 s, one at a time (seeded), each within 1 s: the last one started 1.2 s
    # after the first, and is not timed from then
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _engine(tokenizer, trl_envs.SlowReset, "done", environment_timeout_s=1.0)
    rollout = engine.generate(["q"], [{"prompt": "q"}], 4, seeds=[0])
    assert [e.failures for e in rollout.episodes] == [[]] * 4


def test_a_hung_reset_stops_the_step_at_its_timeout_not_one_per_episode(tiny_model_dir) -> None:
    # resets take turns: the first hung one ends the round, and the episodes after it (which
    # would each wait for the lock it holds) are not started
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _engine(tokenizer, trl_envs.HangingReset, "done", environment_timeout_s=0.5)
    t0 = time.perf_counter()
    with pytest.raises(
        EnvironmentLost, match=r"start failed on the row 'q' \(timed out after 0.5 s\)"
    ):
        engine.generate(["q"], [{"prompt": "q"}], 8, seeds=[0])
    assert time.perf_counter() - t0 < 3  # one timeout, not eight (4 s)
    with SEEDED:  # the abandoned reset ends and gives the lock back before the next test
        pass


def test_a_long_tool_answer_is_cut_at_the_cap_and_counted(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _engine(
        tokenizer, trl_envs.Verbose, [GUESS.format(3), "done"], tool_max_output_chars=100
    )
    turn = engine.generate(["q"], [{"prompt": "q"}], 1, seeds=[0]).turns[0][0]
    assert turn["output"] == "x" * 100 and turn["error"] == "output cut at 100 characters"


def test_a_tool_that_raises_system_exit_is_its_error_not_a_timeout(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _engine(tokenizer, trl_envs.Exits, [GUESS.format(3), "done"])
    t0 = time.perf_counter()
    turn = engine.generate(["q"], [{"prompt": "q"}], 1, seeds=[0]).turns[0][0]
    assert turn["error"] == "SystemExit: 3" and time.perf_counter() - t0 < 4  # the limit is 5 s


def test_a_factory_makes_the_instances_as_trls_environment_factory(tiny_model_dir) -> None:
    # TRL's environment_factory is any callable that returns an instance: a partial, a function
    for factory in (
        functools.partial(trl_envs.Levelled, level=3),
        load_class("trl_envs:make_levelled"),
    ):
        environment = ClassEnvironment(factory)
        assert (environment.name, environment.kind) == ("Levelled", trl_envs.Levelled)
        assert list(environment.signatures) == ["increment"]
        tokenizer = load_tokenizer(tiny_model_dir)
        step = "```\nincrement(2)\n```\n"
        rollout = _engine(tokenizer, factory, [step, "done"]).generate(
            ["q"], [{"prompt": "q"}], 2, seeds=[0]
        )
        assert [e.reward for e in rollout.episodes] == [9.0, 9.0]  # level 3 x (2 + 1)
    with pytest.raises(ConfigError, match=r"Levelled\(\) failed \(TypeError"):
        ClassEnvironment(trl_envs.Levelled)  # the class alone needs its level
