"""verifiers tasksets (``verifiers`` v1) as data: their tasks as prompts (their rewards as
reward functions: ``grpo.rewards.verifiers``).

A taskset is named as ``path/to/file.py:NAME`` or ``module:NAME``, NAME a ``vf.Taskset``
instance or a callable without arguments that returns one (a ``load_taskset`` function):

- **Tasks as prompts**: ``data.task: verifiers`` with ``data.task_args: {taskset: SPEC}``. Each
  task is a row: its prompt as chat messages (the task's ``system_prompt`` first), and the
  columns ``verifiers_taskset`` (the spec) and ``verifiers_task`` (its index in the taskset).
- **Rewards as reward functions**: ``{name: "verifiers:NAME"}`` in ``rewards.functions`` is the
  task's reward NAME, scored over a trace of each completion (``grpo.rewards.verifiers``).

The tasks are read once per process (``tasks``) and kept: a taskset that yields tasks forever
(``INFINITE``) is read up to ``MAX_TASKS``.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

from grpo.data import DataError
from grpo.runtime.user_code import error_line, load_named

MAX_TASKS = 100_000  # tasks read from an infinite taskset


def load_object(spec: str, where: str) -> Any:
    """``path/to/file.py:NAME`` or ``module:NAME``; DataError naming ``where`` if not."""
    try:
        return load_named(spec)
    except ValueError as err:
        raise DataError(f"{where}: {err}") from None


@functools.cache
def tasks(spec: str) -> tuple[Any, ...]:
    """The tasks of the taskset ``spec`` names, in its order."""
    where = f"verifiers taskset {spec}"
    try:
        from verifiers.v1 import Taskset
    except ImportError:
        raise DataError(f"{where}: needs verifiers (pip install 'grpo[envs]')") from None
    found = load_object(spec, where)
    if isinstance(found, Taskset) or not callable(found):
        taskset = found
    else:
        try:
            taskset = found()
        except Exception as err:  # user code: any failure is one line
            raise DataError(f"{where}: calling it failed ({error_line(err)})") from None
    if not isinstance(taskset, Taskset):
        raise DataError(f"{where}: not a verifiers.v1.Taskset ({type(taskset).__name__})")
    try:
        read = tuple(itertools.islice(taskset, MAX_TASKS))
    except Exception as err:  # the taskset's load()
        raise DataError(f"{where}: loading its tasks failed ({error_line(err)})") from None
    if not read:
        raise DataError(f"{where}: no tasks")
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
