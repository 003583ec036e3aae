"""The rewards of a verifiers taskset's tasks (grpo.data.verifiers), on rows that
``data.task: verifiers`` made (their ``verifiers_taskset`` and ``verifiers_task`` columns):
``verifiers`` pays the task's weighted reward (verifiers' ``trace.reward``), ``verifiers:NAME``
its reward NAME alone, logged as ``reward/NAME``. Scoring builds the completion's ``vf.Trace``
(the prompt's messages, each model turn an assistant message, each observation after it a user
message) and runs the task's own ``score``, so every reward sees the trace as in verifiers; a
completion is scored once for all of them."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from grpo.data.verifiers import prompt_messages, tasks
from grpo.rewards.registry import RewardFn, register


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


@functools.lru_cache(maxsize=4096)
def _scores(spec: str, index: int, completion: str, turns: str | None) -> dict[str, Any]:
    scores = score(spec, index, completion, None if turns is None else json.loads(turns))
    weights = {
        fn.__name__: getattr(fn, "_vf_weight", 1.0) for fn in tasks(spec)[index].hooks("reward")
    }
    known = [(v, weights.get(k, 1.0)) for k, v in scores.items() if v is not None]
    return {**scores, "": sum(v * w for v, w in known) if known else None}


def _rewards(
    name: str,
    completions: list[str],
    verifiers_taskset: list[str],
    verifiers_task: list[int],
    turns: list[Any] | None,
) -> list[Any]:
    said = turns or [None] * len(completions)
    out = []
    for c, spec, i, t in zip(completions, verifiers_taskset, verifiers_task, said, strict=True):
        scores = _scores(spec, int(i), c, None if t is None else json.dumps(t, default=str))
        if name not in scores:
            given = ", ".join(k for k in scores if k)
            raise ValueError(
                f"verifiers:{name}: task {i} of {spec} gives no reward {name} ({given})"
            )
        out.append(scores[name])
    return out


def verifiers_reward(name: str) -> RewardFn:
    """The reward NAME of the rows' tasks ('' for their weighted sum)."""

    def reward(
        completions: list[str],
        verifiers_taskset: list[str],
        verifiers_task: list[int],
        turns: list[Any] | None = None,
        **_: Any,
    ) -> list[Any]:
        return _rewards(name, completions, verifiers_taskset, verifiers_task, turns)

    reward.__name__ = name or "verifiers"
    return reward


register("verifiers")(functools.partial(verifiers_reward, ""))
