"""Multi-turn rollouts: the model writes a turn, an environment answers, and the model goes on.

One turn loop serves every engine and every environment (``grpo.environments``: the protocol;
the sandboxed Python tool of ``rollout.tools`` is ``PythonEnvironment`` below). An engine that
can take turns has ``generate_turns(requests, stop, greedy) -> list[list[TurnSample]]``: for each
``TurnRequest`` (a partial sequence as token ids, n samples, a seed, a token limit) n
continuations, each ending at EOS, at the end of a stop string, or at the limit. The loop does
everything else:

1. each completion gets its own episode (``Environment.episode``), started on the prompt's row;
   turn 1 asks for G samples per prompt (one request per prompt, seeded by the prompt's seed);
2. a turn whose text holds an action (``Environment.action``: for the Python tool, a call in one
   of ``CALL_FORMATS``) is sent to its episode (``Episode.step``), and the observation is
   appended: a ``tool`` message through the chat template where the tokenizer has one, else a
   plain ``<output>`` block;
3. every unfinished completion asks for its next turn (one request each, seeded by the prompt's
   seed, its index in the group and its request count), until it answers without an action, its
   episode is done, it reaches ``rollout.max_turns`` model turns, or it has used
   ``rollout.max_new_tokens`` tokens (its turns, observations and template tokens together:
   that completion is truncated).

A completion is the whole interleaved sequence: the model conditions on the observations and
template tokens, but ``Rollout.sampled_mask`` is False on them, so they never enter the loss.
Rewards receive the final turn's text as the completion and the turns (calls, outputs, errors)
as the keyword column ``turns``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from grpo.config import ConfigError, RolloutConfig
from grpo.environments import (
    Action,
    Environment,
    EnvironmentFailure,
    Episode,
    Step,
    ending_tool_call,
)
from grpo.environments.calls import Outcome, run_calls
from grpo.rollout import RolloutLost, decoding_of, grouped_rollout, prompt_seeds, release
from grpo.rollout.padding import left_pad, right_pad
from grpo.rollout.tools import TOOLS, PythonTool, ToolResult
from grpo.step_data import EpisodeRecord, Rollout

# environment calls of one round run concurrently (a Python tool call: its own sandbox process)
ENV_THREADS = 4


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
    found = ending_tool_call(text)
    if found is None:
        return None
    name, arguments = found
    if not isinstance(arguments, dict) or "code" not in arguments:
        return Call(None, 'a tool call is {"name": "python", "arguments": {"code": "..."}}')
    if name not in TOOLS or not isinstance(arguments["code"], str):
        return Call(None, f"unknown tool '{name}' (tools: {', '.join(TOOLS)})")
    return Call(arguments["code"])


@dataclass(frozen=True)
class CallFormat:
    """How calls are written: ``stop`` strings end a turn early (the end of a call), ``parse``
    finds the call that ends a turn's text (None: the turn is an answer)."""

    stop: list[str]
    parse: Callable[[str], Any]


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


@dataclass(frozen=True)
class PythonEpisode:
    """An episode of the Python tool: stateless, each call a fresh sandbox process."""

    tool: PythonTool
    instance = None  # nothing for reward functions

    def start(self, row: dict[str, Any], seed: int) -> None:
        return None

    def step(self, action: Action) -> Step:
        result = self.tool(action.call)
        return Step(result.observation, result.output, result.error)

    def reward(self) -> None:
        return None

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class PythonEnvironment:
    """``rollout.tools: [python]`` as an environment: calls in ``call_format``'s syntax run in
    ``tool``."""

    tool: PythonTool
    call_format: str = "fence"
    name: str = "python"
    has_reward: bool = False

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [PYTHON_TOOL_SCHEMA] if self.call_format == "template" else []

    @property
    def stop(self) -> list[str]:
        return CALL_FORMATS[self.call_format].stop

    def action(self, text: str) -> Action | None:
        call = CALL_FORMATS[self.call_format].parse(text)
        return None if call is None else Action(call.code, call.error)

    def episode(self) -> PythonEpisode:
        return PythonEpisode(self.tool)


def python_environment(config: RolloutConfig) -> PythonEnvironment:
    """The Python tool with the recipe's limits and call syntax."""
    tool = TOOLS[config.tools[0]](
        timeout_s=config.tool_timeout_s, max_output_chars=config.tool_max_output_chars
    )
    return PythonEnvironment(tool, config.tool_call_format)


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
    its turns as plain dicts (what rewards receive) and its environment episode."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    open_text: str = ""  # text of the model turn in progress (continued after a stray stop)
    requests: int = 0
    truncated: bool = False
    sampler_logprobs: bool = True  # the engine reported a log-prob for every sampled token
    episode: Episode | None = None
    record: EpisodeRecord = field(default_factory=EpisodeRecord)

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


def prompt_line(row: dict[str, Any], width: int = 60) -> str:
    """A row named in one line by the start of its prompt (its last message's, for a chat)."""
    prompt = row.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    text = " ".join(str(prompt).split())
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def joined_row(row: dict[str, Any], text: str) -> dict[str, Any]:
    """``row`` with an episode's start ``text`` appended to its prompt (to the last message of a
    conversation), as TRL's trainer joins a reset's text: as it is, no separator added."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return {**row, "prompt": prompt + text}
    return {
        **row,
        "prompt": [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + text}],
    }


class EnvironmentLost(RolloutLost):
    """An environment that cannot go on (``EnvironmentFailure``): the run stops with a
    checkpoint and this one line."""


class MultiTurnEngine:
    """A rollout engine whose completions play an environment (the Python tool of
    ``rollout.tools`` unless one is given); wraps an engine that takes turns. ``render`` renders
    a row as a prompt: needed by environments whose ``start`` text joins the prompt."""

    def __init__(
        self,
        engine: TurnEngine,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig,
        environment: Environment | None = None,
        render: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        if not hasattr(engine, "generate_turns"):
            raise ConfigError("rollout.tools: this rollout engine cannot take turns")
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.environment = environment or python_environment(config)
        self.render = render
        self.format = CallFormat(self.environment.stop, self.environment.action)
        self.use_template = bool(tokenizer.chat_template)
        if self.use_template:  # a template that cannot show tool output fails now, not mid-run
            template_observation(tokenizer, TOOL_PROBE)
        # the template must show the tool list (its call syntax comes with it in Hermes/Qwen)
        if self.environment.tools and not (self.use_template and renders_tools(tokenizer)):
            raise ConfigError(
                "rollout.tool_call_format=template: the tokenizer's chat template does not render "
                "a tool list, so it has no tool-call syntax (use fence)"
            )
        self.eos_texts = {tokenizer.decode([i]) for i in engine.eos}
        self.reported: set[str] = set()  # kinds of environment failure already said

    @property
    def tool(self) -> PythonTool | None:
        """The Python tool, when the environment is the Python tool."""
        return getattr(self.environment, "tool", None)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)

    def close(self) -> None:
        """Release the engine and the environment (an OpenEnv or verifiers one holds a loop
        thread, and verifiers' a listening endpoint)."""
        release(self.engine)
        release(self.environment)

    def observation_ids(self, step: Step | ToolResult, ended_with_eos: bool) -> list[int]:
        """Tokens appended after an action: the template's tool message (the assistant message
        closed first, unless the model's EOS already closed it), or an <output> block."""
        if self.use_template:
            text = template_observation(self.tokenizer, step.observation)
            eos_text = next((e for e in self.eos_texts if text.startswith(e)), None)
            if ended_with_eos and eos_text is not None:
                text = text[len(eos_text) :]
        else:
            text = inline_observation(step.observation)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def run_calls(self, calls: list[Callable[[], Any]]) -> list[Outcome]:
        """The calls' outcomes: concurrent (``ENV_THREADS`` at once), each within
        ``rollout.environment_timeout_s``."""
        return run_calls(calls, ENV_THREADS, self.config.environment_timeout_s)

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

    def _start(
        self,
        paths: list[Trajectory],
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int],
    ) -> list[str]:
        """Start every path's episode on its prompt's row and seed; the prompts, with the text
        the episodes add joined."""
        name = self.environment.name
        starts = [
            functools.partial(path.episode.start, rows[i // group_size], seeds[i // group_size])
            for i, path in enumerate(paths)
        ]
        outcomes = self._starts(paths, starts)
        joined = list(prompts)
        for g, row in enumerate(rows):
            group = outcomes[g * group_size : (g + 1) * group_size]
            failed = next((o.error for o in group if o.error is not None), None)
            if failed is not None:
                raise EnvironmentFailure(
                    f"environment {name}: start failed on the row {prompt_line(row)} ({failed})"
                )
            text = group[0].value
            if any(o.value != text for o in group):
                raise EnvironmentFailure(
                    f"environment {name}: the episodes of one prompt started with different "
                    "texts (a group must face one problem: seed the episode from the seed start() "
                    "receives)"
                )
            if text is not None:
                if self.render is None:
                    raise ConfigError(
                        f"environment {name}: its start text joins the prompt, and this engine "
                        "was given no prompt format to render it"
                    )
                joined[g] = self.render(joined_row(row, text))
        return joined

    def _starts(self, paths: list[Trajectory], starts: list[Callable[[], Any]]) -> list[Outcome]:
        """The episodes' starts: concurrent, or, for an environment whose starts take turns
        anyway (``serial_starts``: a class's, seeded around each reset), one at a time, each
        timed from its own start rather than from when it began to wait, and none after the
        first that fails (the step stops on it; a hung reset still holds the seeding lock)."""
        if not getattr(self.environment, "serial_starts", False):
            return self._timed(paths, starts)
        outcomes: list[Outcome] = []
        for path, start in zip(paths, starts, strict=True):
            outcomes += self._timed([path], [start])
            if outcomes[-1].error is not None:
                break
        return outcomes

    def _timed(self, paths: list[Trajectory], calls: list[Callable[[], Any]]) -> list[Outcome]:
        """Run one call per path; each path's environment time counts its call's, and its share
        of the round's wall time."""
        t0 = time.perf_counter()
        outcomes = self.run_calls(calls)
        share = (time.perf_counter() - t0) / max(1, len(calls))
        for path, outcome in zip(paths, outcomes, strict=True):
            path.record.time_s += outcome.time_s
            path.record.wall_s += share
        return outcomes

    def _finish(self, paths: list[Trajectory]) -> None:
        """Each episode's reward, then its close; failures recorded on the path."""
        rewards = self._timed(paths, [path.episode.reward for path in paths])
        closes = self._timed(paths, [path.episode.close for path in paths])
        for path, reward, close in zip(paths, rewards, closes, strict=True):
            path.record.reward = reward.value
            path.record.instance = path.episode.instance
            for what, outcome in (("reward", reward), ("close", close)):
                if outcome.error is not None:
                    self._fail(path, what, outcome.error)

    def _fail(self, path: Trajectory, what: str, error: str) -> None:
        """Record an environment call that failed; say the first of each kind in one line."""
        path.record.failures.append(f"{what}: {error}")
        if what not in self.reported:
            self.reported.add(what)
            print(
                f"environment {self.environment.name}: {what} failed ({error}); the first "
                "such failure, later ones are counted in env/errors",
                file=sys.stderr,
                flush=True,
            )

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
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: one seed a prompt")
        paths = [
            Trajectory(episode=self.environment.episode()) for _ in range(len(prompts) * group_size)
        ]
        try:
            prompts = self._start(paths, prompts, rows, group_size, seeds)
            prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
            self._play(paths, prompt_ids, group_size, seeds, greedy, temperature)
            self._finish(paths)
        except EnvironmentFailure as failure:
            self.run_calls([path.episode.close for path in paths])
            raise EnvironmentLost(str(failure)) from None
        rollout = self.assemble(prompt_ids, prompts, rows, group_size, paths)
        return replace(rollout, decoding=decoding_of(self.config, temperature))

    def _play(
        self,
        paths: list[Trajectory],
        prompt_ids: list[list[int]],
        group_size: int,
        seeds: list[int],
        greedy: bool,
        temperature: float | None,
    ) -> None:
        """The turns: every path's, round by round, until each has ended."""
        budget = self.config.max_new_tokens
        eos = set(self.engine.eos)
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
            calls: list[tuple[int, Action, bool]] = []
            going_on: list[int] = []
            for i, sample in pending:
                after, action, ended_with_eos = self._take_turn(paths[i], sample, budget, eos)
                if after == "call":
                    calls.append((i, action, ended_with_eos))
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

    def _take_turn(
        self, path: Trajectory, sample: TurnSample, budget: int, eos: set[int]
    ) -> tuple[str, Action | None, bool]:
        """Add a sampled turn to the path and say what comes next: "call" (send the action
        returned to the episode), "more" (a stop string that closed no call: the turn goes on)
        or "end" (the path is done: an answer, EOS, the turn limit or the token budget). Also
        returns whether the sample ended with EOS."""
        path.requests += 1
        path.add(sample.token_ids, True, sample.logprobs)
        ended_with_eos = bool(sample.token_ids) and sample.token_ids[-1] in eos
        path.open_text += self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        room = budget - len(path.ids)
        action = self.format.parse(path.open_text)
        turn = {
            "text": path.open_text,
            "call": None if action is None else action.call,
            "output": None,
            "error": None,
            "time_s": None,  # set when the action is done
        }
        if action is not None and len(path.turns) + 1 < self.config.max_turns and room > 0:
            path.turns.append(turn)
            path.open_text = ""
            return "call", action, ended_with_eos
        if not ended_with_eos and action is None and len(sample.token_ids) > 0 and room > 0:
            return "more", action, ended_with_eos
        path.turns.append(turn)
        path.truncated = room <= 0 and not ended_with_eos
        return "end", action, ended_with_eos

    def _observe_calls(
        self, paths: list[Trajectory], calls: list[tuple[int, Action, bool]], budget: int
    ) -> list[int]:
        """Send the actions (path index, action, whether its turn ended with EOS) to their
        episodes, add each observation to its path within the budget, and return the paths
        with room left to answer. An action that cannot be done is answered with its error,
        nothing run; a step that raises or times out is shown as an error and ends its path."""
        going_on = []
        stepped = [(i, action, eos) for i, action, eos in calls if action.error is None]
        outcomes = self._timed(
            [paths[i] for i, _, _ in stepped],
            [functools.partial(paths[i].episode.step, action) for i, action, _ in stepped],
        )
        steps = {i: outcome for (i, _, _), outcome in zip(stepped, outcomes, strict=True)}
        for i, action, ended_with_eos in calls:
            path = paths[i]
            outcome = steps.get(i)
            failed = outcome is not None and outcome.error is not None
            if outcome is None:  # the action's own error: shown, nothing ran
                step, time_s = Step(f"Error: {action.error}", "", action.error), 0.0
            elif failed:  # the episode's state is unknown now: this completion ends here
                self._fail(path, "step", outcome.error)
                step, time_s = Step(f"Error: {outcome.error}", "", outcome.error), outcome.time_s
            else:
                step, time_s = outcome.value, outcome.time_s
            output = step.observation if step.output is None else step.output
            path.turns[-1].update(output=output, error=step.error, time_s=time_s)
            if step.done or failed:
                path.record.done = step.done
                continue
            ids = self.observation_ids(step, ended_with_eos)
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
        return replace(
            rollout,
            sampled_mask=sampled_mask,
            turns=[p.turns for p in paths],
            episodes=[p.record for p in paths],
        )


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


def env_metrics(
    turns: list[list[dict[str, Any]]], episodes: list[EpisodeRecord]
) -> dict[str, float]:
    """``env/*`` metrics of a batch of multi-turn completions (docs/metrics.md)."""
    n = len(turns)
    # a failed step is already a turn answered with its error
    outside = sum(not f.startswith("step:") for e in episodes for f in e.failures)
    return {
        "env/turns": sum(len(path) for path in turns) / n,
        "env/errors": float(sum(t["error"] is not None for p in turns for t in p) + outside),
        "env/failed_frac": sum(bool(e.failures) for e in episodes) / n,
        "env/done_frac": sum(e.done for e in episodes) / n,
        "env/time_s": sum(e.time_s for e in episodes),
        "time/env_s": sum(e.wall_s for e in episodes),
    }
