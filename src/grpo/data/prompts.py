"""Prompt text: the tokenizer's chat template, or a recipe's own template, and the opened tag.

A dataset row becomes the text the model continues in one of two ways:

- **chat template** (the default when the tokenizer has one and ``data.template`` is unset): the
  row's prompt (or ``data.template`` filled from the row, as the user message), after the system
  prompt and the ``data.few_shot`` example turns, through ``tokenizer.apply_chat_template`` with
  ``data.chat_template_kwargs`` (and the tool schemas, ``tools=[...]``, when the model calls tools
  in its template's own syntax: ``rollout.tool_call_format: template``).
- **plain template** (``data.template`` set, or a tokenizer without a chat template): the
  template filled from the row's columns (``{prompt}``, ``{system}``, any other column), or the
  system prompt, the few-shot turns and the prompt joined by blank lines when there is no
  template (a plain template has its own place for examples: few-shot turns are refused there).

``data.response_prefix`` is appended in both cases: the text the answer starts with.

Special tokens: prompts are tokenized with ``add_special_tokens=False`` everywhere (both
engines, evaluation), so the text must carry them. A chat template writes the BOS token itself
when the model needs one (adding another would double it); plain text gets the tokenizer's BOS
token in front when the tokenizer would add one (Gemma 3 does; SmolLM2 does not).

The opened tag: a prompt that ends by opening a tag (R1-Zero's "Assistant: <think>", or a
``response_prefix`` of ``<answer>``) makes the completion start inside it. Rewards and evaluation
judge ``opened_tag(prompt) + completion``, so format rewards see the whole tagged answer.
"""

from __future__ import annotations

import logging
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from grpo.data import DataError

if TYPE_CHECKING:
    from grpo.config import DataConfig

logger = logging.getLogger(__name__)

# DeepSeek-R1-Zero's template (DeepSeek-AI 2025, Table 1), ending inside an opened <think> as
# in the issue's and most reproductions' versions; "prompt" is the question
R1_ZERO = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
    "here </think> <answer> answer here </answer>. User: {prompt}. Assistant: <think>"
)

TEMPLATES: dict[str, str] = {"r1_zero": R1_ZERO}

# a tag the prompt may leave open for the completion to continue; names as in the format rewards
OPENABLE_TAGS = ("think", "answer")
TRAILING_SPACE_RE = re.compile(r"\s*\Z")


def template_text(template: str) -> str:
    """A built-in template's text, or the template itself."""
    return TEMPLATES.get(template, template)


def template_fields(template: str) -> list[str]:
    """The ``{field}`` names a template uses (``{{`` and ``}}`` are literal braces)."""
    try:
        parsed = list(string.Formatter().parse(template_text(template)))
    except ValueError as err:
        raise DataError(f"data.template is not a valid template: {err}") from None
    names = [name for _, name, _, _ in parsed if name is not None]
    if any(not name.isidentifier() for name in names):
        raise DataError(
            "data.template: fields are column names in braces, like {prompt} ('{{' is a brace)"
        )
    return names


def needs_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer puts a BOS token in front of text it encodes with special tokens."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a", add_special_tokens=True).input_ids[:1] == [bos]


def opened_tag(prompt: str) -> str:
    """The prompt's tail from a tag it opens last and leaves open (only whitespace after it),
    e.g. ``"<think>"`` for "... Assistant: <think>"; ``""`` when the prompt ends otherwise."""
    tail = prompt[: TRAILING_SPACE_RE.search(prompt).start()]
    for name in OPENABLE_TAGS:
        if tail.endswith(f"<{name}>"):
            return prompt[len(tail) - len(name) - 2 :]
    return ""


def scored_texts(prompts: list[str], completions: list[str]) -> list[str]:
    """What rewards and evaluation judge: each completion after its prompt's opened tag."""
    return [opened_tag(p) + c for p, c in zip(prompts, completions, strict=True)]


@dataclass(frozen=True)
class PromptFormat:
    """How rows become prompt text (see the module docstring)."""

    system: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # tool schemas for the chat template
    template: str | None = None
    chat_template: bool | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    few_shot: tuple[dict[str, str], ...] = ()
    response_prefix: str = ""

    def uses_chat_template(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        if self.chat_template is None:
            return bool(tokenizer.chat_template) and self.template is None
        if self.chat_template and not tokenizer.chat_template:
            raise DataError("data.chat_template is true but the tokenizer has no chat template")
        return self.chat_template

    def fill(self, row: dict[str, Any], row_number: int | None = None) -> str:
        """The template filled from the row's columns (and ``system``)."""
        values = {"system": self.system or "", **row}
        text = template_text(self.template or "{prompt}")
        where = "" if row_number is None else f" (row {row_number})"
        for name in template_fields(text):
            if name not in values:
                raise DataError(f"data.template uses '{{{name}}}', a column the data lacks{where}")
            if not isinstance(values[name], str | int | float):
                raise DataError(
                    f"data.template field '{{{name}}}' must be text, got {type(values[name]).__name__}"
                    f"{where}"
                )
        return text.format(**values)

    def check(self, tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]]) -> None:
        """Fail before training on what cannot render (tool schemas without the chat template; a
        column the template uses and a row lacks: every row is filled once); say so when a plain
        template leaves the system prompt out."""
        if self.tools and not self.uses_chat_template(tokenizer):
            raise DataError(
                "rollout.tool_call_format=template needs the chat template to describe the tool: "
                "unset data.template (or use tool_call_format: fence)"
            )
        if self.tools and "tools" in self.chat_template_kwargs:
            raise DataError(
                "data.chat_template_kwargs.tools: the template already gets the schemas of "
                "rollout.tools; leave tools out of chat_template_kwargs"
            )
        if self.template is None:
            return
        if self.few_shot and not self.uses_chat_template(tokenizer):
            raise DataError(
                "data.few_shot needs the chat template: with a plain data.template, "
                "write the examples into the template"
            )
        for i, row in enumerate(rows, start=1):
            self.fill(row, i)
        plain = not self.uses_chat_template(tokenizer)
        if plain and self.system and "system" not in template_fields(self.template):
            logger.warning(
                "data.template has no {system} field: the system prompt is not used "
                "(put {system} in the template, or set data.system_prompt to '')"
            )

    def _messages(self, content: str | list[dict[str, str]]) -> list[dict[str, str]]:
        """System prompt, then the few-shot turns, then the row's own turns; a row that brings
        its own system message keeps it (and the few-shot turns go after it)."""
        messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
        head = [messages[0]] if messages and messages[0].get("role") == "system" else []
        if not head and self.system:
            head = [{"role": "system", "content": self.system}]
        rest = messages[1:] if messages and messages[0].get("role") == "system" else messages
        return [*head, *(dict(turn) for turn in self.few_shot), *rest]

    def render(self, tokenizer: PreTrainedTokenizerBase, row: dict[str, Any]) -> str:
        """The text the model continues for a row (a dict with at least ``prompt``)."""
        if self.uses_chat_template(tokenizer):
            content = self.fill(row) if self.template is not None else row["prompt"]
            tools = {"tools": list(self.tools)} if self.tools else {}
            text = tokenizer.apply_chat_template(
                self._messages(content),
                tokenize=False,
                add_generation_prompt=True,
                **{**self.chat_template_kwargs, **tools},
            )
            return text + self.response_prefix
        if self.template is not None:
            text = self.fill(row)
        else:
            text = "\n\n".join(m["content"] for m in self._messages(row["prompt"])) + "\n"
        bos = tokenizer.bos_token if needs_bos(tokenizer) else ""
        return bos + text + self.response_prefix


def prompt_format_for(
    data: DataConfig, system: str | None, tools: Sequence[dict[str, Any]] = ()
) -> PromptFormat:
    """The prompt format of ``data``; ``tools`` are the tool schemas the chat template renders
    (``grpo.rollout.turns.chat_tools``)."""
    return PromptFormat(
        system=system,
        tools=tuple(tools),
        template=data.template,
        chat_template=data.chat_template,
        chat_template_kwargs=dict(data.chat_template_kwargs),
        few_shot=tuple(turn.model_dump() for turn in data.few_shot),
        response_prefix=data.response_prefix,
    )
