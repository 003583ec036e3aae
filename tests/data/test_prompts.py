"""Prompt templates: chat template or a recipe's own, BOS handling, and the opened tag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import processors

from grpo.config import DataConfig
from grpo.data import DataError
from grpo.data.prompts import R1_ZERO, PromptFormat, opened_tag, prompt_format_for, scored_texts
from grpo.models import load_tokenizer
from grpo.rewards.builtin import format_reward
from grpo.training.trainer import Trainer

ROW = {"prompt": "What is 2 + 3?", "answer": "5", "topic": "sums"}


def with_bos(tokenizer):
    """The tiny tokenizer made to put a BOS token in front of what it encodes (as Gemma's does)."""
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return tokenizer


def test_chat_template_is_the_default_when_there_is_no_template(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    text = PromptFormat(system="Be brief.").render(tok, ROW)
    assert text == "<|system|>Be brief.<|end|><|user|>What is 2 + 3?<|end|><|assistant|>"


def test_plain_template_fills_any_column_and_skips_the_chat_template(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    fmt = PromptFormat(system="S", template="[{topic}] {system} Q: {prompt} A:")
    assert fmt.render(tok, ROW) == "[sums] S Q: What is 2 + 3? A:"
    # the switch: the filled template becomes the user message of the chat template
    wrapped = PromptFormat(template="Q: {prompt}", chat_template=True).render(tok, ROW)
    assert wrapped == "<|user|>Q: What is 2 + 3?<|end|><|assistant|>"


def test_r1_zero_is_built_in_and_ends_inside_think(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    text = PromptFormat(template="r1_zero").render(tok, ROW)
    assert text == R1_ZERO.format(prompt="What is 2 + 3?")
    assert text.startswith("A conversation between User and Assistant.")
    assert text.endswith("User: What is 2 + 3?. Assistant: <think>")
    assert opened_tag(text) == "<think>"


def test_chat_template_kwargs_reach_the_template(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
    )
    assert PromptFormat().render(tok, ROW) == "What is 2 + 3?"
    off = PromptFormat(chat_template_kwargs={"enable_thinking": False})
    assert off.render(tok, ROW) == "What is 2 + 3?[no-think]"


def test_response_prefix_follows_the_generation_prompt(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    text = PromptFormat(response_prefix="<answer>").render(tok, ROW)
    assert text == "<|user|>What is 2 + 3?<|end|><|assistant|><answer>"
    assert opened_tag(text) == "<answer>"


def test_plain_text_gets_one_bos_when_the_tokenizer_adds_one(tiny_model_dir) -> None:
    tok = with_bos(load_tokenizer(str(tiny_model_dir)))
    bos = tok.bos_token_id
    assert tok("a").input_ids[0] == bos  # the tokenizer itself adds it
    tok.chat_template = None
    text = PromptFormat(template="r1_zero").render(tok, ROW)
    ids = tok(text, add_special_tokens=False).input_ids  # how every engine tokenizes prompts
    assert ids[0] == bos and ids.count(bos) == 1


def test_a_chat_template_that_writes_bos_gets_no_second_one(tiny_model_dir) -> None:
    tok = with_bos(load_tokenizer(str(tiny_model_dir)))
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = tok(PromptFormat().render(tok, ROW), add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_no_bos_for_a_tokenizer_that_adds_none(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = None
    assert PromptFormat(system="S").render(tok, ROW) == "S\n\nWhat is 2 + 3?\n"


def test_a_missing_column_names_the_field_and_row(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    fmt = PromptFormat(template="{prompt} ({level})")
    with pytest.raises(DataError, match=r"'\{level\}'.*row 2"):
        fmt.check(tok, [{"prompt": "a", "level": 1}, {"prompt": "b"}])
    with pytest.raises(DataError, match="column names in braces"):
        PromptFormat(template="{0} {prompt}").check(tok, [ROW])


def test_a_plain_template_without_system_says_the_system_prompt_is_unused(
    tiny_model_dir, caplog
) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    PromptFormat(system="Be brief.", template="r1_zero").check(tok, [ROW])
    assert "no {system} field" in caplog.text


def test_opened_tag_only_at_the_end_of_the_prompt() -> None:
    assert opened_tag("Assistant: <think>\n") == "<think>\n"
    assert opened_tag("<|assistant|><answer>") == "<answer>"
    # a tag named (and closed) earlier, or opened mid-prompt, is not where the completion starts
    assert opened_tag("use <think> </think> tags. Assistant:") == ""
    assert opened_tag("<think> then answer") == ""


def test_format_reward_scores_a_completion_that_starts_inside_think() -> None:
    prompt = R1_ZERO.format(prompt="What is 2 + 3?")
    completion = " 2 plus 3 is 5 </think> <answer>5</answer>"
    score = format_reward()
    assert score([completion]) == [0.0]  # the completion alone lacks its opening tag
    assert score(scored_texts([prompt], [completion])) == [1.0]


def test_config_fields_reach_the_format() -> None:
    data = DataConfig(
        template="r1_zero",
        chat_template=False,
        chat_template_kwargs={"x": 1},
        few_shot=[{"role": "user", "content": "q"}],
        response_prefix="p",
    )
    fmt = prompt_format_for(data, "sys")
    assert (
        fmt.template,
        fmt.chat_template,
        fmt.chat_template_kwargs,
        fmt.few_shot,
        fmt.response_prefix,
    ) == ("r1_zero", False, {"x": 1}, ({"role": "user", "content": "q"},), "p")


SHOT = (
    {"role": "user", "content": "1 + 1?"},
    {"role": "assistant", "content": "<answer>2</answer>"},
)


def test_few_shot_turns_go_between_the_system_prompt_and_the_prompt(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    text = PromptFormat(system="S", few_shot=SHOT).render(tok, ROW)
    assert text == (
        "<|system|>S<|end|><|user|>1 + 1?<|end|><|assistant|><answer>2</answer><|end|>"
        "<|user|>What is 2 + 3?<|end|><|assistant|>"
    )
    # a conversational row keeps its own system message, and the examples follow it
    row = {"prompt": [{"role": "system", "content": "R"}, {"role": "user", "content": "Q"}]}
    assert PromptFormat(system="S", few_shot=SHOT).render(tok, row) == (
        "<|system|>R<|end|><|user|>1 + 1?<|end|><|assistant|><answer>2</answer><|end|>"
        "<|user|>Q<|end|><|assistant|>"
    )
    # without a chat template: plain text, turn by turn
    tok.chat_template = None
    assert PromptFormat(few_shot=SHOT).render(tok, ROW) == (
        "1 + 1?\n\n<answer>2</answer>\n\nWhat is 2 + 3?\n"
    )


def test_few_shot_with_a_plain_template_is_refused(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    with pytest.raises(DataError, match="few_shot needs the chat template"):
        PromptFormat(template="Q: {prompt}", few_shot=SHOT).check(tok, [ROW])


def test_a_few_shot_turn_with_an_unknown_role_names_the_field() -> None:
    with pytest.raises(ValueError, match="few_shot"):
        DataConfig(few_shot=[{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="few_shot"):  # the system prompt has its own field
        DataConfig(few_shot=[{"role": "system", "content": "x"}])


def test_training_rewards_see_the_opened_tag(tiny_config, tmp_path: Path) -> None:
    """R1-Zero template: every completion starts inside <think>, so a reward that checks for it
    pays 1 on every completion; the chat template opens nothing and the same reward pays 0."""
    reward_file = tmp_path / "starts_in_think.py"
    reward_file.write_text(
        "def score(completions, **_):\n"
        "    return [float(c.startswith('<think>')) for c in completions]\n"
    )
    rewards = {"functions": [{"name": f"{reward_file}:score"}]}
    for template, expected in (("r1_zero", 1.0), (None, 0.0)):
        config = tiny_config(
            data={"template": template, "task": "arithmetic", "task_args": {"size": 8}},
            rewards=rewards,
            train={"steps": 1, "run_name": f"t-{template}"},
        )
        run_dir = Trainer(config).train()
        metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert metrics["reward/mean"] == expected
        logged = json.loads(
            next((run_dir / "completions").glob("*.jsonl")).read_text().split("\n")[0]
        )
        assert logged["prompt"].endswith("Assistant: <think>") == (template == "r1_zero")
