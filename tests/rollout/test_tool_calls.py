"""How tool calls are written and shown: fenced blocks, template JSON calls, tool lists in
prompts, and tool output through real chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripted_turns import ANSWER, CALL, HERMES_LIKE, QUESTION, ScriptedEngine, rollout_config

from grpo.config import ConfigError, DataConfig, RolloutConfig
from grpo.data import DataError
from grpo.data.prompts import prompt_format_for
from grpo.models import CHAT_TEMPLATE, load_tokenizer
from grpo.rollout.tools import PythonTool
from grpo.rollout.turns import (
    PYTHON_TOOL_SCHEMA,
    MultiTurnEngine,
    chat_tools,
    fence_call,
    renders_tools,
    template_call,
    template_observation,
)


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


def test_a_template_that_drops_tool_output_is_refused_when_the_engine_is_built(
    tiny_model_dir,
) -> None:
    # its generation prompt writes an "x": the start-up probe must not take that for the tool's
    # output, or the run would fail at its first tool call instead
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = (
        CHAT_TEMPLATE.replace(
            "{% for m in messages %}", "{% for m in messages if m['role'] != 'tool' %}"
        )
        + "{% if add_generation_prompt %}<|next|>{% endif %}"
    )
    with pytest.raises(ConfigError, match="does not render a 'tool' message"):
        MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, rollout_config())


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
            ScriptedEngine(tokenizer), tokenizer, rollout_config(tool_call_format="template")
        )
    assert str(raised.value) == (
        "rollout.tool_call_format=template: the tokenizer's chat template does not render "
        "a tool list, so it has no tool-call syntax (use fence)"
    )
    tokenizer.chat_template = HERMES_LIKE
    call = '<tool_call>{"name": "python", "arguments": {"code": "12 * 34"}}</tool_call>'
    config = rollout_config(tool_call_format="template")
    engine = MultiTurnEngine(ScriptedEngine(tokenizer, call=call), tokenizer, config)
    rollout = engine.generate(["q"], [{}], 2, seeds=[0])
    assert engine.format.stop == ["</tool_call>"]
    assert rollout.turns[0][0]["call"] == "12 * 34" and rollout.turns[0][0]["output"] == "408"
    assert rollout.answers == [ANSWER, ANSWER]


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
        MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, rollout_config())


def test_without_a_chat_template_output_is_a_plain_block(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = None
    engine = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, rollout_config())
    ids = engine.observation_ids(PythonTool()("print(2)"), ended_with_eos=False)
    assert tokenizer.decode(ids) == "<output>\n2\n</output>\n"
