"""Environments: what a multi-turn rollout plays against, behind one small protocol.

The turn loop (``grpo.rollout.turns``) drives every environment the same way; the Python tool
(``rollout.tools: [python]``) is one ``Environment`` among others. Per rollout batch:

1. ``environment.episode()`` once per completion (G per prompt), then ``episode.start(row,
   seed)`` with the prompt's dataset row and seed. Text it returns joins the prompt (appended to the prompt's
   last user message and re-rendered with the run's prompt format); the G episodes of a group
   must return the same text (GRPO compares the members of a group on one problem).
2. The model writes a turn. Sampling stops at EOS, at the token budget, or early at one of
   ``environment.stop`` (the end of a call). ``environment.action(text)`` reads the turn's text
   (everything the model wrote since the last observation): an ``Action`` when the turn is one
   the environment acts on, None when it is not (an answer; or, when the turn stopped at a stop
   string without EOS, a stray stop string: the loop lets the model go on writing the turn).
3. ``episode.step(action)`` acts (not called for an ``Action`` whose ``error`` is set: that
   error is shown to the model as it is). Its ``Step.observation`` is shown to the model as the
   next message (a ``tool`` message through the chat template, else an ``<output>`` block) and
   the model writes its next turn, unless ``Step.done``, ``rollout.max_turns`` or the token
   budget ends the completion first. A turn without an action ends the completion too.
4. After the last turn: ``episode.reward()`` (None: the environment has no reward of its own),
   then ``episode.close()``.

Calls of one round (every completion's ``start``, ``step``, ``reward`` and ``close``) run
concurrently on a bounded number of threads (``grpo.environments.calls``), each within
``rollout.environment_timeout_s``: a call that raises or hangs is one line, never a traceback
or a hung run. A ``start`` that fails stops the run (``EnvironmentFailure``: the data or the
environment is broken); a failed ``step`` is shown to the model as an error and ends that
completion; a failed ``reward`` or ``close`` is counted (``env/errors``). Episode outcomes
(reward, done, failures, time) travel with the rollout as ``grpo.step_data.EpisodeRecord``. The turns column that rewards receive records, per
model turn, its ``text``, the ``call`` (``Action.call``), the ``output`` (``Step.output``, else
the observation), the ``error`` (``Action.error`` or ``Step.error``) and the step's ``time_s``.

How an adapter plugs in: write a class with ``name``, ``tools`` (JSON schemas given to the chat
template as ``tools=`` when calls use the template's syntax; [] otherwise), ``stop``,
``has_reward``, ``action(text)`` and ``episode()`` (and ``close()`` where it holds threads,
sockets or servers: called once when the run's engine closes); and an episode class with ``instance``,
``start``, ``step``, ``reward`` and ``close``; then return it from
``grpo.build.environment_of`` for the ``rollout.environment`` values it serves (the class
adapter, ``grpo.environments.classes``, is the worked example). ``reward()``'s value reaches
the reward function ``environment`` (``rewards.functions: [{name: environment}]``) through the
column ``environment_reward``; ``instance`` reaches reward functions as ``environments``. Neither may raise for anything a model or an environment does wrong: a bad call
or a failing environment becomes ``Action.error`` / ``Step.error`` (shown to the model, counted
in ``env/errors``). Raise ``EnvironmentFailure`` only where the run cannot go on (a server that
is gone): the run stops with one line. An adapter that treats every turn as an action (an
environment whose actions are text, as OpenEnv's are) has ``stop = []`` and ``action`` returning
``Action(text)`` for every turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def ending_tool_call(text: str) -> tuple[Any, Any] | None:
    """The name and arguments of the ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    that ends ``text`` (whitespace after it allowed; arguments given as a JSON string are
    decoded, absent ones are {}), as the model wrote them (the caller checks their types);
    (None, None) for a body that is not a JSON object with a name; None when no call ends the
    text. The chat templates' tool-call syntax (Hermes, Qwen), read one way for every tool."""
    stripped = text.rstrip()
    matches = list(TOOL_CALL_RE.finditer(stripped))
    if not matches or matches[-1].end() != len(stripped):
        return None
    try:
        payload = json.loads(matches[-1].group(1))
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        return payload["name"], arguments
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None


class EnvironmentFailure(RuntimeError):
    """An environment that cannot go on (gone, or broken past repair): the run stops with this
    one line."""


@dataclass(frozen=True)
class Action:
    """What a model turn asks the environment to do: ``call`` as the turns column records it
    (the Python tool's code, a ``{"name", "arguments"}`` tool call, an action's text), or why
    it cannot be done (``error``: the model sees it, the loop counts it; ``call`` may be None)."""

    call: Any
    error: str | None = None


@dataclass(frozen=True)
class Step:
    """The environment's answer to an action. ``observation`` is the next message the model
    sees; ``output`` what the turns column records (None: the observation); ``error`` a failure
    to report and count (a raising tool, a bad argument, a timed-out call); ``done`` ends the
    episode (the observation is recorded, not shown)."""

    observation: str
    output: str | None = None
    error: str | None = None
    done: bool = False


class Episode(Protocol):
    """One completion's episode (state lives here, across turns)."""

    # what reward functions receive for it in the ``environments`` column (TRL's environment
    # instance), in the process that made it; None: nothing to give
    instance: Any

    def start(self, row: dict[str, Any], seed: int) -> str | None:
        """Begin on a dataset row, under the prompt's seed (the same for the G episodes of a
        group, and on every run with that seed: seed any randomness from it); text to join the
        prompt, or None."""
        ...

    def step(self, action: Action) -> Step:
        """Act on one model turn's action."""
        ...

    def reward(self) -> float | None:
        """The episode's reward after its last turn; None when the environment gives none."""
        ...

    def close(self) -> None:
        """Release what the episode holds (called once, after ``reward``)."""
        ...


class Environment(Protocol):
    """A kind of episode and how a model's turns address it. An environment whose starts must
    take turns says so with a ``serial_starts = True`` attribute (the loop then starts its
    episodes one at a time, each with the whole timeout)."""

    name: str
    tools: list[dict[str, Any]]  # schemas for the chat template's tools=; [] without
    stop: list[str]  # strings that end a model turn early (the end of a call)
    has_reward: bool  # its episodes score themselves (the reward function ``environment``)

    def action(self, text: str) -> Action | None:
        """The action a model turn's text holds, or None (an answer, or a stray stop)."""
        ...

    def episode(self) -> Episode:
        """A fresh episode (one per completion)."""
        ...
