"""Multi-turn rollouts with the sandboxed Python tool: the tool, the turn loop, the loss mask.

The scripted policy is the tiny model trained to memorise one two-turn exchange: it writes a
python block, stops, sees the tool's output, and answers. Greedy decoding then replays it through
the real HF engine and the real sandbox.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from grpo.config import ConfigError, DataConfig, ModelConfig, RolloutConfig
from grpo.containers import Rollout, Scored
from grpo.data import DataError
from grpo.data.prompts import prompt_format_for
from grpo.models import CHAT_TEMPLATE, load_policy, load_tokenizer
from grpo.rollout import close_engine, render_prompt
from grpo.rollout.hf import HFEngine
from grpo.rollout.tools import PythonTool, last_error_line, notebook_source
from grpo.rollout.turns import (
    PYTHON_TOOL_SCHEMA,
    MultiTurnEngine,
    Trajectory,
    TurnRequest,
    TurnSample,
    chat_tools,
    fence_call,
    renders_tools,
    template_call,
    template_observation,
    tool_metrics,
    turn_seed,
)
from grpo.scoring.logprobs import full_sequence_logprobs
from grpo.training.trainer import Trainer, train

QUESTION = "What is 12 * 34?"
# a template that lists the tools in a system message and says how to call them, as Hermes' and
# Qwen's do (their call syntax: <tool_call>{"name": ..., "arguments": ...}</tool_call>)
HERMES_LIKE = (
    "{% if tools %}<|system|><tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Call one as <tool_call>{name, arguments}</tool_call><|end|>{% endif %}" + CHAT_TEMPLATE
)
CALL = "```python\nprint(12*34)\n```\n"
ANSWER = "<answer>408</answer>"


# ------------------------------------------------------------------------------ the tool


def test_python_tool_prints_output_and_the_last_expression() -> None:
    tool = PythonTool(timeout_s=5)
    assert tool("print(12 * 34)").observation == "408"
    # like a notebook, a final bare expression is shown
    assert tool("x = 12\nx * 34").observation == "408"
    assert tool("print('a')\nNone").observation == "a"


def test_notebook_source_leaves_statements_and_bad_syntax_alone() -> None:
    assert notebook_source("x = 1") == "x = 1"
    assert notebook_source("def f(:") == "def f(:"
    assert "print(repr(__value))" in notebook_source("1 + 1")


def test_notebook_source_prints_the_last_expression_of_several_lines() -> None:
    shown = "\nif __value is not None:\n    print(repr(__value))\n"
    assert notebook_source("a = 1\nb = 2\na + b") == "a = 1\nb = 2\n__value = (a + b)" + shown
    # after a semicolon: the statements before it on its line stay
    assert notebook_source("a = 1\nb = 2; a + b") == "a = 1\nb = 2; __value = (a + b)" + shown


def test_notebook_source_counts_lines_and_columns_as_the_parser_does() -> None:
    tool = PythonTool(timeout_s=5)
    # a line separator or form feed inside a string is no line end; a column counts UTF-8 bytes
    assert tool('s = "a\u2028b\x0cc"\nlen(s)').observation == "5"
    assert tool('x = "é"; len(x)').observation == "1"
    assert tool("x = 2\r\nx * 21").observation == "42"


def test_a_program_that_exits_with_a_message_shows_it() -> None:
    assert PythonTool(timeout_s=5)("raise SystemExit('bye')").error == "bye"
    ended = PythonTool(timeout_s=5)("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert ended.error == "ended by SIGTERM"


def test_python_tool_errors_are_one_line_for_the_model() -> None:
    result = PythonTool(timeout_s=5)("print(1)\n1 / 0")
    assert result.output == "1"
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.observation == "1\nError: ZeroDivisionError: division by zero"


def test_a_hanging_call_is_cut_at_its_time_limit() -> None:
    result = PythonTool(timeout_s=1)("import time\ntime.sleep(60)")
    assert result.error == "timed out after 1 s"
    assert result.time_s < 10


def test_a_flooding_call_is_cut_at_its_output_cap() -> None:
    result = PythonTool(timeout_s=2, max_output_chars=100)("while True:\n    print('x' * 50)")
    assert len(result.output) == 100
    assert result.error.startswith("output cut at 100 characters")
    fits = PythonTool(timeout_s=5, max_output_chars=100)("print('y' * 100)")
    assert fits.output == "y" * 100 and fits.error is None


def test_the_tool_cannot_reach_the_network_or_the_trainers_files(tmp_path: Path) -> None:
    # the same sandbox as the code reward (its adversarial suite is tests/sandbox/test_sandbox.py)
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    tool = PythonTool(timeout_s=5)
    wrote = tool(f"open({str(secret)!r}, 'w').write('pwned')")
    assert wrote.error is not None and secret.read_text() == "s3cret"
    net = tool("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")
    assert net.error is not None


# ------------------------------------------------------------------------------ call formats


def test_a_failure_without_stderr_still_tells_the_model_it_failed() -> None:
    traceback = "Traceback (most recent call last):\n  ...\nValueError: bad\n\n"
    assert last_error_line(traceback) == "ValueError: bad"
    assert last_error_line("") == "the program failed without a message"
    assert last_error_line(" \n\n") == "the program failed without a message"


def test_fence_call_is_a_python_block_that_ends_the_turn() -> None:
    assert fence_call("Let me compute.\n" + CALL).code == "print(12*34)\n"
    assert fence_call("```py\n1+1\n```").code == "1+1\n"
    assert fence_call(CALL + "So the answer is 408.") is None  # the block does not end the turn
    assert fence_call("The answer is 408.") is None


CALL_JSON = '<tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>'


def test_template_call_parses_the_tool_call_json() -> None:
    call = template_call(CALL_JSON)
    assert call.code == "1+1"
    # whitespace after the call (a newline before the turn's end) still ends the turn with it
    assert template_call(CALL_JSON + "\n ").code == "1+1"
    assert template_call(" " + CALL_JSON + " and more") is None
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"2\\"}"}</tool_call>'
    assert template_call(as_string).code == "2"
    bad = template_call("<tool_call>{not json}</tool_call>")
    # the model reads these errors as the call's output
    assert bad.code is None
    assert bad.error == 'a tool call is {"name": "python", "arguments": {"code": "..."}}'
    other = template_call('<tool_call>{"name": "web", "arguments": {"code": "x"}}</tool_call>')
    assert other.code is None and other.error == "unknown tool 'web' (tools: python)"


def test_tool_output_goes_through_the_chat_template(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    # the assistant message is closed, then a tool message, then a new assistant message
    assert template_observation(tokenizer, "408") == "<|end|><|tool|>408<|end|><|assistant|>"


# ------------------------------------------------------------------------------ a scripted engine


class ScriptedEngine:
    """Takes turns from a script: the first turn of every completion writes ``CALL`` (or the
    code given), the next answers with the last tool output it sees. Records every request."""

    def __init__(self, tokenizer, code: str = "print(12*34)", call: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = [tokenizer.eos_token_id]
        self.call = call or f"```python\n{code}\n```\n"
        self.requests: list[TurnRequest] = []

    def sync_weights(self, model) -> None:
        self.synced = model

    def generate_turns(self, requests, stop, greedy=False, temperature=None):
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.tokenizer.decode(r.context, skip_special_tokens=False)
            if "<|tool|>" not in text:  # the call ends at the stop string, without EOS
                reply, end = self.call, []
            else:
                shown = text.rsplit("<|tool|>", 1)[1].split("<|end|>", 1)[0]
                reply, end = f"<answer>{shown}</answer>", self.eos
            ids = [*self.tokenizer(reply, add_special_tokens=False).input_ids, *end]
            ids = ids[: r.max_tokens]
            out.append([TurnSample(list(ids)) for _ in range(r.n)])
        return out


def _rollout_config(**kw) -> RolloutConfig:
    return RolloutConfig(**{"tools": ["python"], "group_size": 2, "max_new_tokens": 200, **kw})


def test_turn_loop_runs_the_call_and_masks_the_observation(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, _rollout_config())
    prompt = render_prompt(tokenizer, QUESTION, None)
    rollout = engine.generate([prompt], [{"answer": "408"}], 2, seeds=[7])
    call_ids = tokenizer(CALL, add_special_tokens=False).input_ids
    shown = tokenizer("<|end|><|tool|>408<|end|><|assistant|>", add_special_tokens=False).input_ids
    answer_ids = [*tokenizer(ANSWER, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    expected = call_ids + shown + answer_ids
    for i in range(2):
        n = int(rollout.completion_mask[i].sum())
        assert rollout.completion_ids[i, :n].tolist() == expected
        # the loss mask is False exactly on the observation (tool output and template tokens)
        own = [True] * len(call_ids) + [False] * len(shown) + [True] * len(answer_ids)
        assert rollout.sampled_mask[i, :n].tolist() == own
        assert rollout.loss_mask[i].sum() == len(call_ids) + len(answer_ids)
    assert rollout.answers == [ANSWER, ANSWER]
    turns = rollout.turns[0]
    assert [t["call"] for t in turns] == ["print(12*34)\n", None]
    assert turns[0]["output"] == "408" and turns[0]["error"] is None
    assert not rollout.truncated.any()
    metrics = tool_metrics(rollout.turns)
    assert metrics["tools/calls_per_completion"] == 1.0
    assert metrics["tools/turns_per_completion"] == 2.0
    assert metrics["tools/error_rate"] == 0.0


def test_the_turn_loop_pushes_the_trainers_weights_to_its_engine(tiny_model_dir) -> None:
    scripted = ScriptedEngine(load_tokenizer(tiny_model_dir))
    policy = torch.nn.Linear(1, 1)
    MultiTurnEngine(scripted, scripted.tokenizer, _rollout_config()).sync_weights(policy)
    assert scripted.synced is policy


def test_closing_the_turn_loop_closes_its_engine(tiny_model_dir) -> None:
    # close_engine calls an engine's close where it has one (vLLM's engine core must go before
    # the process group it joined); the turn loop passes its own close on to its engine
    scripted = ScriptedEngine(load_tokenizer(tiny_model_dir))
    closed: list[object] = []
    scripted.close = lambda: closed.append(scripted)
    MultiTurnEngine(scripted, scripted.tokenizer, _rollout_config()).close()
    close_engine(object())  # no close: nothing to do, no error
    assert closed == [scripted]


def test_greedy_eval_gives_each_prompt_one_completion_in_batches(tiny_model_dir) -> None:
    from grpo.data.stream import sampling_seed
    from grpo.eval import EvalSettings, generate

    scripted = ScriptedEngine(load_tokenizer(tiny_model_dir))
    engine = MultiTurnEngine(scripted, scripted.tokenizer, _rollout_config())
    rollout = generate(engine, ["a", "b", "c"], [{}] * 3, 1, True, EvalSettings(batch_size=2))
    assert rollout.answers == [ANSWER] * 3
    assert [[t["output"] for t in c] for c in rollout.turns] == [["408", None]] * 3
    # batches of 2 then 1 prompt: the batch's call turns (each prompt's eval seed), then its
    # answer turns (the seed of turn 1 of member 0), one sample each
    seeds = [sampling_seed(0, i) for i in range(3)]
    first = [(1, s) for s in seeds]
    later = [(1, turn_seed(s, 0, 1)) for s in seeds]
    expected = [first[0], first[1], later[0], later[1], first[2], later[2]]
    assert [(r.n, r.seed) for r in scripted.requests] == expected


def test_later_turns_are_seeded_by_prompt_seed_member_and_request(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    scripted = ScriptedEngine(tokenizer)
    engine = MultiTurnEngine(scripted, tokenizer, _rollout_config())
    engine.generate(["a", "b"], [{}, {}], 2, seeds=[5, 9])
    first, later = scripted.requests[:2], scripted.requests[2:]
    assert [(r.n, r.seed) for r in first] == [(2, 5), (2, 9)]
    assert [r.seed for r in later] == [turn_seed(s, m, 1) for s in (5, 9) for m in (0, 1)]
    assert len({turn_seed(5, m, k) for m in range(4) for k in range(4)}) == 16


def test_a_failing_call_is_shown_as_an_error_and_the_rollout_goes_on(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    scripted = ScriptedEngine(tokenizer, code="import time\ntime.sleep(60)")
    engine = MultiTurnEngine(scripted, tokenizer, _rollout_config(tool_timeout_s=1))
    rollout = engine.generate(["q"], [{}], 2, seeds=[0])
    assert rollout.turns[0][0]["error"] == "timed out after 1 s"
    assert rollout.answers[0] == "<answer>Error: timed out after 1 s</answer>"
    assert tool_metrics(rollout.turns)["tools/error_rate"] == 1.0


def test_max_turns_and_the_token_budget_end_a_completion(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    one_turn = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, _rollout_config(max_turns=1))
    rollout = one_turn.generate(["q"], [{}], 2, seeds=[0])
    # the last allowed turn is a call: it is not run, the completion ends there
    assert [len(t) for t in rollout.turns] == [1, 1]
    assert rollout.turns[0][0]["call"] == "print(12*34)\n" and rollout.turns[0][0]["time_s"] is None
    assert not rollout.truncated.any()
    call_len = len(tokenizer(CALL, add_special_tokens=False).input_ids)
    # room for the call and part of the observation only: truncated, never past the budget
    tight = RolloutConfig(tools=["python"], group_size=2, max_new_tokens=call_len + 5)
    rollout = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, tight).generate(
        ["q"], [{}], 2, seeds=[0]
    )
    assert rollout.completion_mask.sum(dim=1).tolist() == [call_len + 5] * 2
    assert rollout.truncated.all()
    assert rollout.loss_mask.sum(dim=1).tolist() == [call_len] * 2


# tool lists as real templates write them: ChatML (Hermes, Qwen) joins the message's fields
# with "+" (a missing field is an error), Mistral shows the tools just before the last user
# message and refuses any role but user and assistant
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
)
MISTRAL_TOOLS = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{% if tools and loop.last %}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m['content'] }}"
    "[/INST]{% elif m['role'] == 'assistant' %}{{ m['content'] }}</s>{% elif m['role'] == 'tool' %}"
    "[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "shows"),
    [(CHATML_TOOLS, True), (MISTRAL_TOOLS, True), (HERMES_LIKE, True), (CHAT_TEMPLATE, False)],
)
def test_renders_tools_tells_whether_the_template_lists_tools(
    tiny_model_dir, template: str, shows: bool
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = template
    assert renders_tools(tokenizer) is shows


def test_tool_output_as_mistrals_template_shows_it(tiny_model_dir) -> None:
    # the assistant message is closed, then the tool results; a template that refuses any role
    # but its own still renders the probe conversation
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = MISTRAL_TOOLS
    assert template_observation(tokenizer, "408") == "</s>[TOOL_RESULTS]408[/TOOL_RESULTS]"
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{% for m in messages %}", "{% for m in messages if m['role'] != 'tool' %}"
    )
    with pytest.raises(ConfigError) as raised:
        template_observation(tokenizer, "408")
    assert str(raised.value) == (
        "rollout.tools: the tokenizer's chat template does not render a 'tool' message "
        "after an assistant message"
    )


def test_tool_output_as_chatmls_template_shows_it(tiny_model_dir) -> None:
    # ChatML joins each message's fields with "+": the probe conversation gives every message
    # its content
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = (
        CHATML_TOOLS + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert template_observation(tokenizer, "408") == (
        "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_call_format_runs_the_json_call(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(ConfigError) as raised:
        MultiTurnEngine(
            ScriptedEngine(tokenizer), tokenizer, _rollout_config(tool_call_format="template")
        )
    assert str(raised.value) == (
        "rollout.tool_call_format=template: the tokenizer's chat template does not render "
        "a tool list, so it has no tool-call syntax (use fence)"
    )
    tokenizer.chat_template = HERMES_LIKE
    call = '<tool_call>{"name": "python", "arguments": {"code": "12 * 34"}}</tool_call>'
    config = _rollout_config(tool_call_format="template")
    engine = MultiTurnEngine(ScriptedEngine(tokenizer, call=call), tokenizer, config)
    rollout = engine.generate(["q"], [{}], 2, seeds=[0])
    assert engine.format.stop == ["</tool_call>"]
    assert rollout.turns[0][0]["call"] == "12 * 34" and rollout.turns[0][0]["output"] == "408"
    assert rollout.answers == [ANSWER, ANSWER]


@pytest.fixture(scope="module")
def hermes_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny model with a chat template that lists tools (``HERMES_LIKE``)."""
    model_dir = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = HERMES_LIKE
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _tool_prompt(tokenizer) -> str:
    """The question as the template shows it with the python tool listed."""
    user = [{"role": "user", "content": QUESTION}]
    return tokenizer.apply_chat_template(
        user, tools=[PYTHON_TOOL_SCHEMA], tokenize=False, add_generation_prompt=True
    )


def test_template_calls_show_the_tool_schema_in_every_prompt(
    tiny_config, hermes_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = hermes_model_dir
    tokenizer = load_tokenizer(model_dir)
    call = '<tool_call>{"name": "python", "arguments": {"code": "12 * 34"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, call=call)
    config = tiny_config(
        model={"name": str(model_dir)},
        data={"task": None, "path": str(_question_file(tmp_path))},
        rollout={"tools": ["python"], "tool_call_format": "template", "max_new_tokens": 200},
        train={"steps": 1},
    )
    train(config, engine)
    # the prompts the engine was given: the template's tool list, the schema in it, the question
    shown = _tool_prompt(tokenizer)
    assert shown.startswith('<|system|><tools>{"type": "function", "function": {"name": "python"')
    firsts = [r.context for r in engine.requests if r.n == config.rollout.group_size]
    assert len(firsts) == config.rollout.prompts_per_step
    assert {tokenizer.decode(ids) for ids in firsts} == {shown}


def test_curate_shows_the_tool_schema_too(
    hermes_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from grpo.cli import main
    from grpo.data.prompts import PromptFormat

    rendered: list[str] = []
    render = PromptFormat.render
    monkeypatch.setattr(
        PromptFormat, "render", lambda self, *a: rendered.append(render(self, *a)) or rendered[-1]
    )
    recipe = tmp_path / "recipe.json"  # JSON is YAML
    recipe.write_text(
        json.dumps(
            {
                "model": {"name": str(hermes_model_dir)},
                "data": {"task": None, "path": str(_question_file(tmp_path))},
                "rollout": {
                    "tools": ["python"],
                    "tool_call_format": "template",
                    "max_new_tokens": 8,
                },
                "rewards": {"functions": [{"name": "accuracy"}]},
                "train": {"progress": False},
            }
        )
    )
    out = tmp_path / "kept.jsonl"
    assert main(["curate", str(recipe), "--samples", "2", "--output", str(out)]) == 0
    assert len(rendered) == 4 and set(rendered) == {_tool_prompt(load_tokenizer(hermes_model_dir))}


def test_fence_calls_leave_prompts_unchanged(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = HERMES_LIKE
    row, data = {"prompt": QUESTION}, DataConfig()
    fence = RolloutConfig(tools=["python"])
    template = RolloutConfig(tools=["python"], tool_call_format="template")
    assert chat_tools(fence) == [] and chat_tools(RolloutConfig()) == []
    assert chat_tools(template) == [PYTHON_TOOL_SCHEMA]
    bare = prompt_format_for(data, "sys").render(tokenizer, row)
    assert bare == "<|system|>sys<|end|><|user|>What is 12 * 34?<|end|><|assistant|>"
    assert prompt_format_for(data, "sys", chat_tools(fence)).render(tokenizer, row) == bare
    listed = prompt_format_for(data, "sys", chat_tools(template)).render(tokenizer, row)
    assert listed.startswith("<|system|><tools>") and listed.endswith(bare)
    # a plain-text template has nowhere to list the tool: refused before training
    plain = prompt_format_for(DataConfig(template="Q: {prompt}"), None, chat_tools(template))
    with pytest.raises(DataError, match="tool_call_format=template needs the chat template"):
        plain.check(tokenizer, [row])


def test_template_without_a_tool_role_is_a_config_error(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ConfigError, match="tool"):
        MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, _rollout_config())


def test_without_a_chat_template_output_is_a_plain_block(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = None
    engine = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, _rollout_config())
    ids = engine.observation_ids(PythonTool()("print(2)"), ended_with_eos=False)
    assert tokenizer.decode(ids) == "<output>\n2\n</output>\n"


# ------------------------------------------------------------------------------ gradients


def _two_turn_rollout(tokenizer) -> tuple[Rollout, int, int, int]:
    """One group of two hand-built completions: call, observation, answer (the second shorter)."""
    prompt = tokenizer(render_prompt(tokenizer, QUESTION, None), add_special_tokens=False).input_ids
    call = tokenizer(CALL, add_special_tokens=False).input_ids
    shown = tokenizer("<|end|><|tool|>408<|end|><|assistant|>", add_special_tokens=False).input_ids
    answer = [*tokenizer(ANSWER, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    rows = [call + shown + answer, call + shown + answer[:4]]
    width = len(rows[0])
    ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    sampled = mask.clone()
    sampled[:, len(call) : len(call) + len(shown)] = False
    rollout = Rollout(
        prompt_ids=torch.tensor([prompt, prompt]),
        prompt_mask=torch.ones(2, len(prompt), dtype=torch.bool),
        completion_ids=ids,
        completion_mask=mask,
        truncated=torch.tensor([False, True]),
        prompts=["p", "p"],
        completions=["", ""],
        rows=[{}],
        group_size=2,
        sampled_mask=sampled,
    )
    return rollout, len(prompt), len(call), len(shown)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trainer_gradient_equals_a_loop_over_the_models_own_tokens(tiny_config, loss_type) -> None:
    config = tiny_config(
        rollout={"tools": ["python"], "group_size": 2},
        algorithm={"beta": 0.0, "loss_type": loss_type},
        optim={"max_grad_norm": None, "micro_batch_size": 2},
    )
    trainer = Trainer(config)
    tokenizer = trainer.tokenizer
    rollout, _, n_call, n_shown = _two_turn_rollout(tokenizer)
    advantages = torch.tensor([1.0, -1.0])
    scored = Scored(rollout, torch.zeros(2, 1), ["x"], torch.zeros(2), advantages)
    start = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    got = {}
    step = trainer.optimizer.step

    def keep_gradients(*args, **kwargs):  # the update frees them once its step is taken
        got.update({k: p.grad.detach().clone() for k, p in trainer.policy.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = keep_gradients
    trainer.optimize(scored)

    # reference: a fresh copy of the starting weights, one on-policy pass (ratio 1, gradient of
    # ratio = gradient of logp): grpo: loss = -1/G sum_i A_i mean_t logp_i,t; dapo: loss =
    # -sum_i A_i sum_t logp_i,t / (own tokens of both); t runs over the model's own tokens only,
    # each log-prob from one forward over the whole sequence
    model = load_policy(ModelConfig(name=config.model.name), config.model.name)
    model.load_state_dict(start)
    model.train()
    loss = torch.zeros(())
    own_total = int(rollout.loss_mask.sum())
    for i in range(2):
        n = int(rollout.completion_mask[i].sum())
        seq = torch.cat([rollout.prompt_ids[i], rollout.completion_ids[i, :n]])[None]
        logits = model(input_ids=seq).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        s = rollout.prompt_ids.shape[1]
        own = [t for t in range(n) if not n_call <= t < n_call + n_shown]
        terms = torch.stack([logp[s + t - 1, rollout.completion_ids[i, t]] for t in own])
        if loss_type == "grpo":
            loss = loss - advantages[i] * terms.mean() / 2
        else:
            loss = loss - advantages[i] * terms.sum() / own_total
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_observation_tokens_get_exactly_zero_weight(tiny_model_dir) -> None:
    from grpo.algorithm import policy_loss

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    rollout, _, n_call, n_shown = _two_turn_rollout(tokenizer)
    logp, _ = full_sequence_logprobs(
        model,
        rollout.prompt_ids,
        rollout.prompt_mask,
        rollout.completion_ids,
        rollout.completion_mask,
    )
    logp = logp.detach().requires_grad_(True)
    loss, _ = policy_loss(
        logp,
        logp.detach(),
        torch.tensor([1.0, -1.0]),
        rollout.loss_mask,
        clip_low=0.2,
        clip_high=0.2,
        beta=0.0,
        loss_type="grpo",
    )
    loss.backward()
    shown = slice(n_call, n_call + n_shown)
    assert torch.equal(logp.grad[:, shown], torch.zeros_like(logp.grad[:, shown]))
    assert (logp.grad[:, :n_call] != 0).all()
    # and changing the log-probs there changes nothing
    moved = logp.detach().clone()
    moved[:, shown] += 3.0
    again, _ = policy_loss(
        moved,
        logp.detach(),
        torch.tensor([1.0, -1.0]),
        rollout.loss_mask,
        clip_low=0.2,
        clip_high=0.2,
        beta=0.0,
        loss_type="grpo",
    )
    assert torch.equal(again, loss)


# ------------------------------------------------------------------------------ scripted policy


def train_scripted(model_dir: Path, out: Path) -> Path:
    """The model at ``model_dir`` trained to replay: question -> CALL -> (tool output) -> ANSWER
    + EOS, saved at ``out``."""
    tokenizer = load_tokenizer(model_dir)
    model = load_policy(ModelConfig(name=str(model_dir)), str(model_dir))
    text = render_prompt(tokenizer, QUESTION, None) + CALL
    text += template_observation(tokenizer, "408") + ANSWER
    ids = torch.tensor(
        [[*tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]]
    )
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 5e-3:  # ~70 steps; the whole exchange then has probability ~0.7
            break
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def scripted_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return train_scripted(tiny_model_dir, tmp_path_factory.mktemp("scripted"))


def test_hf_engine_replays_the_scripted_exchange(scripted_model_dir: Path) -> None:
    tokenizer = load_tokenizer(scripted_model_dir)
    model = load_policy(ModelConfig(name=str(scripted_model_dir)), str(scripted_model_dir))
    config = _rollout_config()
    engine = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    prompt = render_prompt(tokenizer, QUESTION, None)
    rollout = engine.generate([prompt], [{}], 2, seeds=[0], greedy=True)
    # the stop string ended turn 1 at the closing fence; the real sandbox ran the call
    assert rollout.turns[0][0]["text"] == CALL
    assert rollout.turns[0][0]["output"] == "408"
    assert rollout.answers == [ANSWER, ANSWER]
    # sampled (not greedy) completions depend on the prompt's seed only, not on the batch
    sampling = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    alone = sampling.generate([prompt], [{}], 2, seeds=[3])
    both = sampling.generate([prompt, prompt + "x"], [{}, {}], 2, seeds=[3, 4])
    n = alone.completion_ids.shape[1]
    assert torch.equal(alone.completion_ids, both.completion_ids[:2, :n])
    assert torch.equal(alone.sampled_mask, both.sampled_mask[:2, :n])


def test_a_tool_rollout_packs_the_weights_once_for_all_its_turns(scripted_model_dir, monkeypatch):
    # under bf16 the HF engine packs its linear layers per session; the turn loop holds one
    # session around its turns, so a two-turn rollout packs each layer once, not twice
    from grpo.rollout import hf

    tokenizer = load_tokenizer(scripted_model_dir)
    model = load_policy(ModelConfig(name=str(scripted_model_dir)), str(scripted_model_dir))
    if not hf._packs(torch.nn.Linear(1, 1).bfloat16()):
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    config = _rollout_config()
    engine = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    reorder, packed = torch.ops.mkldnn._reorder_linear_weight, []
    monkeypatch.setattr(
        torch.ops.mkldnn, "_reorder_linear_weight", lambda w: packed.append(1) or reorder(w)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prompts = [render_prompt(tokenizer, QUESTION, None)]
        rollout = engine.generate(prompts, [{}], 1, seeds=[0], greedy=True)
    assert len(rollout.turns[0]) >= 2  # the call, its output, then the answer
    assert len(packed) == sum(type(m) is torch.nn.Linear for m in model.modules())


def _tool_recipe(tiny_config, scripted_model_dir: Path, tmp_path: Path, **train_args):
    reward = tmp_path / "used_tool.py"
    reward.write_text(
        "def used_tool(completions, turns, answer, **kw):\n"
        "    # the final answer text and the turns arrive as keyword data\n"
        "    return [float(a in c) + 0.5 * sum(t['output'] == a for t in ts)\n"
        "            for c, ts, a in zip(completions, turns, answer)]\n"
    )
    return tiny_config(
        model={"name": str(scripted_model_dir)},
        data={"task": None, "path": str(_question_file(tmp_path))},
        rollout={"tools": ["python"], "max_new_tokens": 120, "max_turns": 3},
        rewards={"functions": [{"name": f"{reward}:used_tool"}]},
        train={"save_every": 1, "log_completions": 2, **train_args},
    )


def _question_file(tmp_path: Path) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": QUESTION, "answer": "408"}) + "\n" for _ in range(4))
    )
    return path


def _metrics(run_dir: Path) -> list[dict]:
    """Each step's metrics (event rows, such as where a resume continued, left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "event" not in row]


def test_multi_turn_grpo_runs_from_a_recipe_and_resumes_exactly(
    tiny_config, scripted_model_dir: Path, tmp_path: Path
) -> None:
    straight = train(_tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=2, run_name="a"))
    metrics = _metrics(straight)
    assert metrics[0]["tools/calls_per_completion"] > 0.5
    # a replayed exchange earns 1.5 (the answer, and it matches the tool's output), others ~0
    assert metrics[0]["reward/mean"] > 0.5
    record = json.loads(
        (straight / "completions" / "step-000001.jsonl").read_text().splitlines()[0]
    )
    assert record["turns"][0]["output"] == "408"
    train(_tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=1, run_name="b"))
    resumed = train(_tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=2, run_name="b"))

    def strip(ms: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if "time" not in k and k != "tokens_per_s"} for m in ms]

    assert strip(_metrics(resumed)) == strip(metrics)


def test_held_out_eval_answers_through_the_tool_loop(
    tiny_config, scripted_model_dir: Path, tmp_path: Path
) -> None:
    from grpo.eval import evaluate_config

    config = _tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=1, eval_every=1)
    config.data.eval_path = config.data.path
    # `grpo eval`: the greedy answer after the call is right, and every answer called the tool
    result = evaluate_config(config, samples=1, examples=None)
    assert result["accuracy"] == 1.0 and result["tools/call_frac"] == 1.0
    # the trainer's held-out eval, at step 0 and after its step
    logged = [m for m in _metrics(train(config)) if "eval/accuracy" in m]
    assert logged[0]["eval/accuracy"] == 1.0 and logged[0]["eval/tools/call_frac"] == 1.0


def test_every_tool_metric_is_in_the_glossary(
    tiny_config, scripted_model_dir: Path, tmp_path: Path
) -> None:
    from test_glossary import documented_metrics

    config = _tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=1)
    logged = set(_metrics(train(config))[0])
    tools = {k for k in logged if k.startswith("tools/")}
    assert tools == {
        "tools/calls_per_completion",
        "tools/call_frac",
        "tools/error_rate",
        "tools/time_s",
        "tools/turns_per_completion",
    }
    assert tools <= documented_metrics()


def test_error_rate_is_undefined_without_calls() -> None:
    metrics = tool_metrics(
        [[{"text": "4", "call": None, "output": None, "error": None, "time_s": None}]]
    )
    assert metrics["tools/calls_per_completion"] == 0.0
    assert math.isnan(metrics["tools/error_rate"])


# ------------------------------------------------------------------------------ vLLM engine


class ScriptedLLM:
    """vllm.LLM's ``generate`` over ``ScriptedEngine``'s script: each sampled token's log-prob
    is -0.5; the sampling parameters of every request are recorded."""

    def __init__(self, tokenizer) -> None:
        self.script = ScriptedEngine(tokenizer)
        self.params: list[dict] = []

    def generate(self, requests, params, use_tqdm=False):
        from types import SimpleNamespace

        out = []
        for request, p in zip(requests, params, strict=True):
            self.params.append(p)
            turn = TurnRequest(request["prompt_token_ids"], p["n"], p["seed"], p["max_tokens"])
            samples = self.script.generate_turns([turn], p["stop"])[0]
            outputs = [
                SimpleNamespace(
                    index=k,
                    token_ids=s.token_ids,
                    logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in s.token_ids],
                )
                for k, s in enumerate(samples)
            ]
            out.append(SimpleNamespace(outputs=outputs[::-1]))
        return out

    def apply_model(self, func):
        return []

    def reset_prefix_cache(self) -> None:
        pass


def test_vllm_engine_takes_turns_through_the_same_loop(tiny_model_dir) -> None:
    from grpo.rollout.vllm import VLLMEngine

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    config = _rollout_config(temperature=0.8)
    llm = ScriptedLLM(tokenizer)
    vllm = VLLMEngine(model, tokenizer, config, llm=llm, sampling_params=dict)
    engine = MultiTurnEngine(vllm, tokenizer, config)
    rollout = engine.generate([render_prompt(tokenizer, QUESTION, None)], [{}], 2, seeds=[4])
    assert rollout.answers == [ANSWER, ANSWER]
    first, second = llm.params[0], llm.params[1]
    assert (first["n"], first["seed"], second["n"]) == (2, 4, 1)
    assert first["stop"] == ["```\n"] and first["include_stop_str_in_output"]
    assert first["temperature"] == 0.8 and first["stop_token_ids"] == [tokenizer.eos_token_id]
    # the sampler's log-probs on the model's tokens, 0 on the observation
    own = rollout.sampled_mask & rollout.completion_mask
    assert torch.equal(rollout.sampler_logp[own], torch.full((int(own.sum()),), -0.5))
    assert (rollout.sampler_logp[~own] == 0).all()


def test_vllm_greedy_turns_ask_for_one_sample_per_request(tiny_model_dir) -> None:
    from grpo.rollout.vllm import VLLMEngine

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    llm = ScriptedLLM(tokenizer)
    vllm = VLLMEngine(model, tokenizer, _rollout_config(), llm=llm, sampling_params=dict)
    out = vllm.generate_turns([TurnRequest([5], 3, 1, 9), TurnRequest([6], 3, 2, 9)], [], True)
    assert [len(group) for group in out] == [3, 3]
    # vLLM refuses n > 1 with greedy sampling: 6 requests of n=1 at temperature 0
    assert [(p["n"], p["temperature"], p["seed"]) for p in llm.params] == [(1, 0.0, 1)] * 3 + [
        (1, 0.0, 2)
    ] * 3


@pytest.mark.slow
def test_real_vllm_replays_the_scripted_exchange(tmp_path: Path) -> None:
    """vLLM's CPU build (when installed): the same greedy turns as the HF engine."""
    pytest.importorskip("vllm")
    from grpo.models import build_tiny_model
    from grpo.rollout.vllm import VLLMEngine

    # vLLM's CPU attention takes head sizes like 64, not the tiny model's 16
    wide = build_tiny_model(tmp_path / "wide", hidden_size=256)
    scripted_model_dir = train_scripted(wide, tmp_path / "scripted")
    tokenizer = load_tokenizer(scripted_model_dir)
    model = load_policy(ModelConfig(name=str(scripted_model_dir)), str(scripted_model_dir))
    config = _rollout_config(vllm_gpu_memory_utilization=0.1, vllm_dtype="float32")
    prompt = [render_prompt(tokenizer, QUESTION, None)]
    hf = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    expected = hf.generate(prompt, [{}], 2, seeds=[0], greedy=True)
    engine = MultiTurnEngine(VLLMEngine(model, tokenizer, config), tokenizer, config)
    rollout = engine.generate(prompt, [{}], 2, seeds=[0], greedy=True)
    texts = [[t["text"] for t in turns] for turns in rollout.turns]
    assert texts == [[t["text"] for t in turns] for turns in expected.turns]
    assert torch.equal(rollout.completion_ids, expected.completion_ids)
    assert torch.equal(rollout.sampled_mask, expected.sampled_mask)


# ------------------------------------------------------------------------------ the loop's edges


class ReplyEngine:
    """Replies from a script: the k-th batch of requests gets ``replies[k]`` (the last one
    repeated), cut to each request's token budget; "<|end|>" is its EOS. Records every request
    with the greedy flag and temperature it came with."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.eos = [tokenizer.convert_tokens_to_ids("<|end|>")]
        self.replies = replies
        self.batches = 0
        self.requests: list[tuple[TurnRequest, bool, float | None]] = []

    def sync_weights(self, model) -> None:
        pass

    def generate_turns(self, requests, stop, greedy=False, temperature=None):
        reply = self.replies[min(self.batches, len(self.replies) - 1)]
        self.batches += 1
        ids = self.tokenizer(reply, add_special_tokens=False).input_ids
        self.requests += [(r, greedy, temperature) for r in requests]
        return [[TurnSample(ids[: r.max_tokens]) for _ in range(r.n)] for r in requests]


END = "<|end|>"
NO_CALL = "```text\nhi\n```\n"  # ends at the fence's stop string, yet is no python call


def _turn(text: str, call=None, output=None, error=None, time_s=None) -> dict:
    return {"text": text, "call": call, "output": output, "error": error, "time_s": time_s}


def _run(tokenizer, replies: list[str], seeds=(3,), **config):
    scripted = ReplyEngine(tokenizer, replies)
    engine = MultiTurnEngine(scripted, tokenizer, _rollout_config(**config))
    rollout = engine.generate(["q"] * len(seeds), [{}] * len(seeds), 1, seeds=list(seeds))
    return rollout, scripted.requests


def test_a_stop_string_that_closes_no_call_continues_the_turn(tiny_model_dir) -> None:
    # the turn goes on (however short its pieces) until EOS; its text is every piece
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout, requests = _run(tokenizer, [NO_CALL, "x", ANSWER + END])
    assert rollout.turns == [[_turn(NO_CALL + "x" + ANSWER)]]
    # later requests are seeded by the request count: 1, then 2
    assert [r.seed for r, *_ in requests] == [3, turn_seed(3, 0, 1), turn_seed(3, 0, 2)]
    sizes = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in (NO_CALL, "x")]
    assert [r.max_tokens for r, *_ in requests] == [200, 200 - sizes[0], 200 - sum(sizes)]
    assert not rollout.truncated.any()


def test_an_empty_turn_ends_the_completion(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout, requests = _run(tokenizer, ["", ANSWER + END])
    assert len(requests) == 1 and rollout.turns == [[_turn("")]]
    assert not rollout.truncated.any()


def test_greedy_temperature_and_drawn_seeds_reach_every_request(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    scripted = ReplyEngine(tokenizer, [NO_CALL, ANSWER + END])
    engine = MultiTurnEngine(scripted, tokenizer, _rollout_config())
    rollout = engine.generate(["q"] * 8, [{}] * 8, 1, temperature=0.7, greedy=True)  # seeds drawn
    assert rollout.sampling.temperature == 0.7  # recorded as sampled
    assert len(scripted.requests) == 16
    assert all(greedy is True and t == 0.7 for _, greedy, t in scripted.requests)
    seeds = [r.seed for r, *_ in scripted.requests[:8]]
    # 62-bit seeds, as turn_seed's; 8 draws below 2**32 would be a 1 in 2**240 event
    assert all(0 <= s < 2**62 for s in seeds) and max(seeds) >= 2**32
    assert [r.seed for r, *_ in scripted.requests[8:]] == [turn_seed(s, 0, 1) for s in seeds]
    with pytest.raises(ValueError):  # one seed per prompt
        engine.generate(["q", "q"], [{}, {}], 1, seeds=[1])


def test_turn_seeds_are_pinned() -> None:
    # a function of (seed, member, request) only: the same numbers on every machine and version
    assert turn_seed(0, 0, 1) == 161281735863300736
    assert turn_seed(5, 1, 2) == 4373636395895995945


def test_sampler_logprobs_hold_only_when_every_sampled_piece_had_them() -> None:
    path = Trajectory()
    path.add([1, 2], True, [-0.1, -0.2])
    path.add([3], False)  # an observation needs none
    assert path.sampler_logprobs
    path.add([4], True)  # a sampled piece without log-probs
    path.add([5], True, [-0.3])
    assert not path.sampler_logprobs


CODE_CALL = "```python\nprint(12*34)\n```\n"


def test_the_token_budget_and_max_turns_decide_whether_a_call_runs(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    size = len(tokenizer(CODE_CALL, add_special_tokens=False).input_ids)
    code = "print(12*34)\n"
    # the call fills the budget: no room for its output, it does not run; cut by length
    rollout, _ = _run(tokenizer, [CODE_CALL], max_new_tokens=size)
    assert rollout.turns == [[_turn(CODE_CALL, call=code)]] and rollout.truncated.all()
    # one token of room: it runs, its output is cut to that token, cut by length
    rollout, _ = _run(tokenizer, [CODE_CALL], max_new_tokens=size + 1)
    assert rollout.turns[0][0]["output"] == "408" and rollout.truncated.all()
    assert int(rollout.completion_mask.sum()) == size + 1
    # max_turns = 1: the call cannot run (its output would need a second turn); not truncated
    rollout, _ = _run(tokenizer, [CODE_CALL], max_new_tokens=size + 1, max_turns=1)
    assert rollout.turns == [[_turn(CODE_CALL, call=code)]] and not rollout.truncated.any()
    # max_turns = 2: a call and the answer
    rollout, _ = _run(tokenizer, [CODE_CALL, ANSWER + END], max_turns=2)
    assert [t["output"] for t in rollout.turns[0]] == ["408", None]
    metrics = tool_metrics(rollout.turns)
    assert metrics["tools/time_s"] == rollout.turns[0][0]["time_s"] > 0  # the call's run time
    # a turn that is no call with one token of room left goes on, with a budget of one token
    size = len(tokenizer(NO_CALL, add_special_tokens=False).input_ids)
    rollout, requests = _run(tokenizer, [NO_CALL, ANSWER + END], max_new_tokens=size + 1)
    assert [r.max_tokens for r, *_ in requests] == [size + 1, 1] and rollout.truncated.all()


def test_a_call_that_cannot_run_answers_with_its_error(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = HERMES_LIKE
    web = '<tool_call>{"name": "web", "arguments": {"code": "x"}}</tool_call>'
    rollout, requests = _run(tokenizer, [web, ANSWER + END], tool_call_format="template")
    error = "unknown tool 'web' (tools: python)"
    assert rollout.turns == [
        [_turn(web, output="", error=error, time_s=0.0), _turn(ANSWER)]
    ]  # nothing ran: no output, no time
    seen = tokenizer.decode(requests[1][0].context)
    assert seen.endswith(f"<|tool|>Error: {error}<|end|><|assistant|>")
    assert tool_metrics(rollout.turns)["tools/error_rate"] == 1.0


def test_the_models_eos_closes_its_message_before_the_tool_output(tiny_model_dir) -> None:
    # the template's tool message starts by closing the assistant message ("<|end|>"): when
    # the model's own EOS closed it, that text is not added a second time
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    block = "```python\nprint(12*34)\n```"
    for call, shown in [(block + END, "<|tool|>408"), (CODE_CALL, "<|end|><|tool|>408")]:
        rollout, _ = _run(tokenizer, [call, ANSWER + END])
        n = int(rollout.completion_mask[0].sum())
        observation = ids(shown + "<|end|><|assistant|>")
        expected = ids(call) + observation + ids(ANSWER + END)
        assert rollout.completion_ids[0, :n].tolist() == expected


def test_a_tokenizer_that_adds_bos_adds_none_to_prompts_or_tool_output(tiny_model_dir) -> None:
    # Llama's and gemma's tokenizers prepend BOS; the rendered prompt already holds it and a
    # tool observation sits mid-sequence: neither is tokenized with special tokens
    from tokenizers.processors import TemplateProcessing

    tokenizer = load_tokenizer(tiny_model_dir)
    bos = tokenizer.convert_tokens_to_ids("<|system|>")  # stands in for a BOS token
    single = TemplateProcessing(single="<|system|> $A", special_tokens=[("<|system|>", bos)])
    tokenizer.backend_tokenizer.post_processor = single
    assert tokenizer("q").input_ids[0] == bos
    rollout, requests = _run(tokenizer, [CODE_CALL, ANSWER + END])
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    assert requests[0][0].context == ids("q")
    n = int(rollout.completion_mask[0].sum())
    shown = ids("<|end|><|tool|>408<|end|><|assistant|>")
    assert rollout.completion_ids[0, :n].tolist() == ids(CODE_CALL) + shown + ids(ANSWER + END)


def test_an_engine_that_cannot_take_turns_is_a_config_error(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(ConfigError) as raised:
        MultiTurnEngine(object(), tokenizer, _rollout_config())
    assert str(raised.value) == "rollout.tools: this rollout engine cannot take turns"


def test_the_tool_runs_with_the_configured_limits(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    config = _rollout_config(tool_timeout_s=3, tool_max_output_chars=50)
    engine = MultiTurnEngine(ReplyEngine(tokenizer, [END]), tokenizer, config)
    assert engine.tool == PythonTool(timeout_s=3, max_output_chars=50)


def test_completions_are_as_wide_as_the_longest_and_without_sampler_logprobs(
    tiny_model_dir,
) -> None:
    # every completion is the EOS alone: one column; the engine reports no log-probs: none
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout, _ = _run(tokenizer, [END], seeds=(3, 4))
    eos = tokenizer.convert_tokens_to_ids(END)
    assert rollout.completion_ids.tolist() == [[eos], [eos]]
    assert rollout.sampler_logp is None


def test_an_observation_that_fills_the_budget_ends_the_completion(tiny_model_dir) -> None:
    # the call and its output use every token: no request for an answer, cut by length
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    shown = ids("<|end|><|tool|>408<|end|><|assistant|>")
    budget = len(ids(CODE_CALL)) + len(shown)
    rollout, requests = _run(tokenizer, [CODE_CALL, ANSWER + END], max_new_tokens=budget)
    assert len(requests) == 1
    assert [(t["call"], t["output"]) for t in rollout.turns[0]] == [("print(12*34)\n", "408")]
    assert rollout.truncated.all() and int(rollout.completion_mask.sum()) == budget


def test_a_data_column_named_turns_is_refused_in_a_tool_run(tiny_config, tmp_path) -> None:
    from grpo.data import DataError

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "1", "turns": 3}) + "\n")
    with pytest.raises(DataError, match="column 'turns' has the name"):
        Trainer(tiny_config(data={"path": str(data)}, rollout={"tools": ["python"]}))
    Trainer(tiny_config(data={"path": str(data)}))  # without tools it is a column like any other
