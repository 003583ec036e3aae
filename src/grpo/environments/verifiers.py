"""verifiers tasksets (``verifiers`` v1): their tasks as prompts, their rewards as reward
functions.

A taskset is named as ``path/to/file.py:NAME`` or ``module:NAME``, NAME a ``vf.Taskset``
instance or a callable without arguments that returns one (a ``load_taskset`` function):

- **Tasks as prompts**: ``data.task: verifiers`` with ``data.task_args: {taskset: SPEC}``. Each
  task is a row: its prompt as chat messages (the task's ``system_prompt`` first), and the
  columns ``verifiers_taskset`` (the spec) and ``verifiers_task`` (its index in the taskset).
- **Rewards as reward functions**: ``{name: "verifiers:NAME"}`` in ``rewards.functions`` is the
  task's reward NAME (a ``@vf.reward`` method or a config-plugged one), logged as
  ``reward/NAME``. Scoring builds the episode's ``vf.Trace`` (the prompt's messages, then the
  completion's turns as assistant messages and their observations as user messages) and runs
  the task's own ``score``: every reward of the task sees the trace, as in verifiers.

The tasks are read once per process (``tasks``) and kept: a taskset that yields tasks forever
(``INFINITE``) is read up to ``MAX_TASKS``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import itertools
from pathlib import Path
from typing import Any

from grpo.config import ConfigError

MAX_TASKS = 100_000  # tasks read from an infinite taskset


def load_object(spec: str, where: str) -> Any:
    """``path/to/file.py:NAME`` or ``module:NAME``; ConfigError naming ``where`` if not."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ConfigError(f"{where}: expected path/to/file.py:NAME or module:NAME, got '{spec}'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"{where}: file {path} not found")
        module_spec = importlib.util.spec_from_file_location(f"grpo_taskset_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:  # user code: any failure is one line
            raise ConfigError(f"{where}: importing {path} failed ({one_line(err)})") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as err:  # an ImportError, or the module's own code failing
            raise ConfigError(f"{where}: cannot import {target} ({one_line(err)})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{where}: {target} has no {name}")
    return getattr(module, name)


def one_line(err: BaseException) -> str:
    said = " ".join(str(err).split())[:300]
    return f"{type(err).__name__}: {said}" if said else type(err).__name__


@functools.cache
def tasks(spec: str) -> tuple[Any, ...]:
    """The tasks of the taskset ``spec`` names, in its order."""
    where = f"verifiers taskset {spec}"
    try:
        from verifiers.v1 import Taskset
    except ImportError:
        raise ConfigError(f"{where}: needs verifiers (pip install 'grpo[envs]')") from None
    found = load_object(spec, where)
    if isinstance(found, Taskset) or not callable(found):
        taskset = found
    else:
        try:
            taskset = found()
        except Exception as err:  # user code: any failure is one line
            raise ConfigError(f"{where}: calling it failed ({one_line(err)})") from None
    if not isinstance(taskset, Taskset):
        raise ConfigError(f"{where}: not a verifiers.v1.Taskset ({type(taskset).__name__})")
    try:
        read = tuple(itertools.islice(taskset, MAX_TASKS))
    except Exception as err:  # the taskset's load()
        raise ConfigError(f"{where}: loading its tasks failed ({one_line(err)})") from None
    if not read:
        raise ConfigError(f"{where}: no tasks")
    return read


def prompt_messages(task: Any) -> list[dict[str, str]]:
    """A task's prompt as chat messages: its system prompt, then its prompt (text or messages)."""
    from verifiers.v1.types import content_text

    data = task.data
    messages = (
        [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
    )
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    return [
        *messages,
        *({"role": m.role, "content": content_text(m.content)} for m in data.prompt or []),
    ]


def taskset_rows(split: str = "train", seed: int = 0, taskset: str = "") -> list[dict[str, Any]]:
    """``data.task: verifiers``: one row per task of ``taskset`` (its prompt as messages, its
    spec and index as columns). A taskset has one split: its tasks."""
    if not taskset:
        raise TypeError("data.task_args.taskset: the taskset, path/to/file.py:NAME")
    return [
        {
            "prompt": prompt_messages(task),
            "verifiers_taskset": taskset,
            "verifiers_task": i,
        }
        for i, task in enumerate(tasks(taskset))
    ]


def reward_names(spec: str) -> list[str]:
    """The names of the rewards a taskset's tasks give (those of its first task)."""
    return [fn.__name__ for fn in tasks(spec)[0].hooks("reward")]


def trace_of(task: Any, completion: str, turns: list[dict[str, Any]] | None) -> Any:
    """The ``vf.Trace`` of one completion: the prompt's messages, each model turn as an
    assistant message and each observation after it as a user message."""
    from verifiers.v1 import AgentConfig, AssistantMessage, SystemMessage, UserMessage
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    messages = [kinds[m["role"]](content=m["content"]) for m in prompt_messages(task)]
    said = turns or [{"text": completion, "output": None}]
    for turn in said:
        messages.append(AssistantMessage(content=turn["text"]))
        if turn is not said[-1] and turn.get("output") is not None:
            messages.append(UserMessage(content=turn["output"]))
    nodes = [
        MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
        for i, m in enumerate(messages)
    ]
    return Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=AgentConfig()),
        nodes=nodes,
    )


def score(
    spec: str, index: int, completion: str, turns: list[dict[str, Any]] | None = None
) -> dict[str, float | None]:
    """Every reward of task ``index`` of taskset ``spec`` on one completion (None: a reward
    that gave no score)."""
    task = tasks(spec)[index]
    trace = trace_of(task, completion, turns)
    asyncio.run(task.score(trace))
    return {name: None if r is None else r.score for name, r in trace.rewards.items()}
