"""Multi-turn rollouts: the model writes a tool call, sees the tool's output, and goes on.

One turn loop serves every engine. An engine that can take turns has
``generate_turns(requests, stop, greedy) -> list[list[TurnSample]]``: for each ``TurnRequest``
(a partial sequence as token ids, n samples, a seed, a token limit) n continuations, each ending
at EOS, at the end of a stop string, or at the limit. The loop does everything else:

1. turn 1 asks for G samples per prompt (one request per prompt, seeded by the prompt's seed);
2. a turn whose text ends in a tool call (``CALL_FORMATS``) runs the call in the sandbox
   (``grpo.rollout.tools``), and the output is appended as an observation: a ``tool`` message
   through the chat template where the tokenizer has one, else a plain ``<output>`` block;
3. every unfinished completion asks for its next turn (one request each, seeded by the prompt's
   seed, its index in the group and its request count), until it answers without a call, reaches
   ``rollout.max_turns`` model turns, or has used ``rollout.max_new_tokens`` tokens (its turns,
   tool outputs and template tokens together: that completion is truncated).

A completion is the whole interleaved sequence: the model conditions on the tool outputs and
template tokens, but ``Rollout.sampled_mask`` is False on them, so they never enter the loss.
Rewards receive the final turn's text as the completion and the turns (calls, outputs, errors)
as the keyword column ``turns``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from grpo.config import ConfigError, RolloutConfig
from grpo.rollout import close_engine, decoding_of, grouped_rollout, prompt_seeds
from grpo.rollout.padding import left_pad, right_pad
from grpo.rollout.tools import TOOLS, ToolResult
from grpo.step_data import Rollout

# tool calls of one round run concurrently (each in its own sandbox process)
TOOL_THREADS = 4


@dataclass(frozen=True)
class TurnRequest:
    """Continue ``context`` (token ids) ``n`` times, at most ``max_tokens`` tokens each."""

    context: list[int]
    n: int
    seed: int
    max_tokens: int


@dataclass
class TurnSample:
    """One continuation: its tokens (the EOS or the stop string included) and, when the engine
    reports them, the sampler's log-prob of each."""

    token_ids: list[int]
    logprobs: list[float] | None = None


class TurnEngine(Protocol):
    eos: list[int]

    def generate_turns(
        self,
        requests: list[TurnRequest],
        stop: list[str],
        greedy: bool = False,
        temperature: float | None = None,
    ) -> list[list[TurnSample]]: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


# ------------------------------------------------------------------------------ call formats


@dataclass(frozen=True)
class Call:
    """A tool call found in a turn: the code to run, or why it cannot run."""

    code: str | None
    error: str | None = None


FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def fence_call(text: str) -> Call | None:
    """A fenced python block that ends the turn (only whitespace after its closing fence)."""
    stripped = text.rstrip()
    for match in FENCE_RE.finditer(stripped):
        if match.end() == len(stripped):
            return Call(match.group(1))
    return None


def template_call(text: str) -> Call | None:
    """A ``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`` that ends the
    turn (the syntax of Hermes/Qwen style chat templates)."""
    stripped = text.rstrip()
    matches = list(TOOL_CALL_RE.finditer(stripped))
    if not matches or matches[-1].end() != len(stripped):
        return None
    try:
        payload = json.loads(matches[-1].group(1))
        arguments = payload["arguments"]
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        name, code = payload["name"], arguments["code"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return Call(None, 'a tool call is {"name": "python", "arguments": {"code": "..."}}')
    if name not in TOOLS or not isinstance(code, str):
        return Call(None, f"unknown tool '{name}' (tools: {', '.join(TOOLS)})")
    return Call(code)


@dataclass(frozen=True)
class CallFormat:
    """How calls are written: ``stop`` strings end a turn early (the end of a call), ``parse``
    finds the call that ends a turn's text (None: the turn is an answer)."""

    stop: list[str]
    parse: Callable[[str], Call | None]


CALL_FORMATS = {
    # "```\n" closes a block but never opens a python one ("```python\n")
    "fence": CallFormat(stop=["```\n"], parse=fence_call),
    "template": CallFormat(stop=["</tool_call>"], parse=template_call),
}

PYTHON_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python snippet in a fresh sandbox and return what it prints "
        "(the value of a final bare expression is printed too).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source"}},
            "required": ["code"],
        },
    },
}
TOOL_SCHEMAS = {"python": PYTHON_TOOL_SCHEMA}


def chat_tools(config: RolloutConfig) -> list[dict[str, Any]]:
    """The schemas of ``rollout.tools`` that prompts give the chat template (``tools=``), so the
    model sees them described as its template was trained to show them: with the template's own
    call syntax only (fenced calls are explained by the prompt)."""
    if config.tool_call_format != "template":
        return []
    return [TOOL_SCHEMAS[name] for name in config.tools]


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template shows a tool list given as ``tools=``."""
    chat = [{"role": "user", "content": "u"}]
    bare = tokenizer.apply_chat_template(chat, tokenize=False)
    return bare != tokenizer.apply_chat_template(chat, tools=[PYTHON_TOOL_SCHEMA], tokenize=False)


# ------------------------------------------------------------------------------ observations

MARK = "\x00grpo-turn\x00"
# the tool output the start-up check renders: text no template writes of its own (a probe of
# "x" passed a template that drops tool messages but writes an "x" in its generation prompt)
TOOL_PROBE = "grpo-tool-probe-7f3a"


def template_observation(tokenizer: PreTrainedTokenizerBase, content: str) -> str:
    """The chat template's text between an assistant message's content and the next assistant
    message's content, with a ``tool`` message holding ``content`` between them."""
    chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
    base = tokenizer.apply_chat_template(chat, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*chat, {"role": "tool", "content": content}], tokenize=False, add_generation_prompt=True
    )
    if not full.startswith(base) or content not in full[len(base) :]:
        raise ConfigError(
            "rollout.tools: the tokenizer's chat template does not render a 'tool' message "
            "after an assistant message"
        )
    return base[base.rindex(MARK) + len(MARK) :] + full[len(base) :]


def inline_observation(content: str) -> str:
    return f"<output>\n{content}\n</output>\n"


# ------------------------------------------------------------------------------ the loop


@dataclass
class Trajectory:
    """One completion being built: tokens, which of them the policy sampled, sampler log-probs,
    and its turns as plain dicts (what rewards receive)."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    open_text: str = ""  # text of the model turn in progress (continued after a stray stop)
    requests: int = 0
    truncated: bool = False
    sampler_logprobs: bool = True  # the engine reported a log-prob for every sampled token

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.sampler_logprobs &= logprobs is not None or not sampled


def turn_seed(seed: int, member: int, request: int) -> int:
    """Seed of a completion's later requests: a function of the prompt's seed, the completion's
    index in its group and the request count only (so batch and rank never matter)."""
    digest = hashlib.blake2b(f"{seed}:{member}:{request}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class MultiTurnEngine:
    """A rollout engine whose completions may call tools; wraps an engine that takes turns."""

    def __init__(
        self,
        engine: TurnEngine,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig,
    ) -> None:
        if not hasattr(engine, "generate_turns"):
            raise ConfigError("rollout.tools: this rollout engine cannot take turns")
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.format = CALL_FORMATS[config.tool_call_format]
        self.tool = TOOLS[config.tools[0]](
            timeout_s=config.tool_timeout_s, max_output_chars=config.tool_max_output_chars
        )
        self.use_template = bool(tokenizer.chat_template)
        if self.use_template:  # a template that cannot show tool output fails now, not mid-run
            template_observation(tokenizer, TOOL_PROBE)
        # the template must show the tool list (its call syntax comes with it in Hermes/Qwen)
        template_calls = config.tool_call_format == "template"
        if template_calls and not (self.use_template and renders_tools(tokenizer)):
            raise ConfigError(
                "rollout.tool_call_format=template: the tokenizer's chat template does not render "
                "a tool list, so it has no tool-call syntax (use fence)"
            )
        self.eos_texts = {tokenizer.decode([i]) for i in engine.eos}

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)

    def close(self) -> None:
        close_engine(self.engine)

    def observation_ids(self, result: ToolResult, ended_with_eos: bool) -> list[int]:
        """Tokens appended after a call: the template's tool message (the assistant message
        closed first, unless the model's EOS already closed it), or an <output> block."""
        if self.use_template:
            text = template_observation(self.tokenizer, result.observation)
            eos_text = next((e for e in self.eos_texts if text.startswith(e)), None)
            if ended_with_eos and eos_text is not None:
                text = text[len(eos_text) :]
        else:
            text = inline_observation(result.observation)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def run_calls(self, calls: list[Call]) -> list[ToolResult]:
        def run(call: Call) -> ToolResult:
            if call.code is None:
                return ToolResult("", call.error, 0.0)
            return self.tool(call.code)

        with ThreadPoolExecutor(max_workers=TOOL_THREADS) as pool:
            return list(pool.map(run, calls))

    def session(self) -> contextlib.AbstractContextManager:
        """The engine's sampling session (``HFEngine.session``), where it has one."""
        return getattr(self.engine, "session", contextlib.nullcontext)()

    def generate(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int] | None = None,
        temperature: float | None = None,
        greedy: bool = False,
    ) -> Rollout:
        with self.session():  # every turn samples from the same weights
            return self._generate(prompts, rows, group_size, seeds, temperature, greedy)

    def _generate(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int] | None,
        temperature: float | None,
        greedy: bool,
    ) -> Rollout:
        seeds = prompt_seeds(seeds, len(prompts))
        budget = self.config.max_new_tokens
        eos = set(self.engine.eos)
        prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        paths = [Trajectory() for _ in range(len(prompts) * group_size)]
        first = self.engine.generate_turns(
            [
                TurnRequest(ids, group_size, s, budget)
                for ids, s in zip(prompt_ids, seeds, strict=True)
            ],
            self.format.stop,
            greedy,
            temperature,
        )
        pending = [(i, sample) for i, sample in enumerate(s for group in first for s in group)]
        while pending:
            calls: list[tuple[int, Call, bool]] = []
            going_on: list[int] = []
            for i, sample in pending:
                after, call, ended_with_eos = self._take_turn(paths[i], sample, budget, eos)
                if after == "call":
                    calls.append((i, call, ended_with_eos))
                elif after == "more":
                    going_on.append(i)
            going_on += self._observe_calls(paths, calls, budget)
            going_on.sort()
            requests = [
                TurnRequest(
                    prompt_ids[i // group_size] + paths[i].ids,
                    1,
                    turn_seed(seeds[i // group_size], i % group_size, paths[i].requests),
                    budget - len(paths[i].ids),
                )
                for i in going_on
            ]
            samples = (
                self.engine.generate_turns(requests, self.format.stop, greedy, temperature)
                if requests
                else []
            )
            pending = [(i, out[0]) for i, out in zip(going_on, samples, strict=True)]
        rollout = self.assemble(prompt_ids, prompts, rows, group_size, paths)
        return replace(rollout, decoding=decoding_of(self.config, temperature))

    def _take_turn(
        self, path: Trajectory, sample: TurnSample, budget: int, eos: set[int]
    ) -> tuple[str, Call | None, bool]:
        """Add a sampled turn to the path and say what comes next: "call" (run the call
        returned), "more" (a stop string that closed no call: the turn goes on) or "end"
        (the path is done: an answer, EOS, the turn limit or the token budget). Also returns
        whether the sample ended with EOS."""
        path.requests += 1
        path.add(sample.token_ids, True, sample.logprobs)
        ended_with_eos = bool(sample.token_ids) and sample.token_ids[-1] in eos
        path.open_text += self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        room = budget - len(path.ids)
        call = self.format.parse(path.open_text)
        turn = {
            "text": path.open_text,
            "call": None if call is None else call.code,
            "output": None,
            "error": None,
            "time_s": None,  # set when the call runs
        }
        if call is not None and len(path.turns) + 1 < self.config.max_turns and room > 0:
            path.turns.append(turn)
            path.open_text = ""
            return "call", call, ended_with_eos
        if not ended_with_eos and call is None and len(sample.token_ids) > 0 and room > 0:
            return "more", call, ended_with_eos
        path.turns.append(turn)
        path.truncated = room <= 0 and not ended_with_eos
        return "end", call, ended_with_eos

    def _observe_calls(
        self, paths: list[Trajectory], calls: list[tuple[int, Call, bool]], budget: int
    ) -> list[int]:
        """Run the calls (path index, call, whether its turn ended with EOS), add each output
        to its path within the budget, and return the paths with room left to answer."""
        going_on = []
        results = self.run_calls([call for _, call, _ in calls])
        for (i, _, ended_with_eos), result in zip(calls, results, strict=True):
            path = paths[i]
            path.turns[-1].update(output=result.output, error=result.error, time_s=result.time_s)
            ids = self.observation_ids(result, ended_with_eos)
            room = budget - len(path.ids)
            path.add(ids[:room], False)
            if len(ids) >= room:  # no room left for the model to answer
                path.truncated = True
            else:
                going_on.append(i)
        return going_on

    def assemble(
        self,
        prompt_ids: list[list[int]],
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        paths: list[Trajectory],
    ) -> Rollout:
        pad = self.tokenizer.pad_token_id
        completion_ids, completion_mask = right_pad([p.ids for p in paths], pad)  # [N, T]
        sampled_mask, _ = right_pad([p.sampled for p in paths], False, torch.bool)
        logp, _ = right_pad([p.logprobs for p in paths], 0.0, torch.float32)
        prompt_t, prompt_mask = left_pad(prompt_ids, pad)  # [P, S]
        rollout = grouped_rollout(
            self.tokenizer,
            prompt_t,
            prompt_mask,
            completion_ids,
            completion_mask,
            torch.tensor([p.truncated for p in paths]),
            prompts,
            rows,
            group_size,
            logp if all(p.sampler_logprobs for p in paths) else None,
        )
        return replace(rollout, sampled_mask=sampled_mask, turns=[p.turns for p in paths])


def tool_metrics(turns: list[list[dict[str, Any]]]) -> dict[str, float]:
    """``tools/*`` metrics of a batch of multi-turn completions (docs/metrics.md)."""
    ran = [[t for t in path if t["time_s"] is not None] for path in turns]
    calls = sum(len(r) for r in ran)
    errors = sum(t["error"] is not None for r in ran for t in r)
    n = len(turns)
    return {
        "tools/calls_per_completion": calls / n,
        "tools/call_frac": sum(bool(r) for r in ran) / n,
        "tools/error_rate": errors / calls if calls else math.nan,
        "tools/time_s": sum(t["time_s"] for r in ran for t in r),
        "tools/turns_per_completion": sum(len(path) for path in turns) / n,
    }
