"""Reward functions: the protocol, the registry of built-ins, and the runner.

A reward function is any callable
``f(completions: list[str], *, prompts: list, completion_ids: list[list[int]], **columns)
-> list[float | None]``: dataset columns arrive as keyword lists aligned with ``completions``;
``None`` means "not applicable" (excluded from that function's mean, weighted as 0).
Functions with a true ``batched`` attribute get the whole batch in one call (a reward model);
the others are called one completion at a time in a thread pool, so slow verifiers overlap and
one failing completion falls back alone. A function with a ``close()`` method is closed with the
runner (worker processes of the math verifier, the reward model's weights).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo.config import RewardsConfig, RewardSpec

RewardFn = Callable[..., list[float | None]]

# name -> constructor taking the spec's `args` and returning a reward function
REGISTRY: dict[str, Callable[..., RewardFn]] = {}


class RewardError(ValueError):
    """A reward function that cannot be set up; one line for the user."""


def register(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        REGISTRY[name] = factory
        return factory

    return wrap


def _import_user_function(ref: str) -> RewardFn:
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise RewardError(f"reward '{ref}': file {path} not found")
        spec = importlib.util.spec_from_file_location(f"grpo_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # user code: any failure is reported in one line
            raise RewardError(f"reward '{ref}': importing {path} failed: {err!r}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise RewardError(f"reward '{ref}': cannot import module '{target}' ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward '{ref}': '{attr}' is not a function in {target}")
    return fn


def resolve_reward(spec: RewardSpec) -> RewardFn:
    """A built-in (constructed with spec.args), or a user function by module:fn / file.py:fn."""
    _load_builtins()
    if spec.name in REGISTRY:
        try:
            return REGISTRY[spec.name](**spec.args)
        except TypeError as err:
            raise RewardError(f"reward '{spec.name}': bad args {spec.args}: {err}") from None
    if ":" in spec.name:
        if spec.args:
            raise RewardError(f"reward '{spec.name}': args are only for built-in rewards")
        return _import_user_function(spec.name)
    known = ", ".join(sorted(REGISTRY))
    raise RewardError(f"unknown reward '{spec.name}' (built-ins: {known}; or module:function)")


BUILTIN_MODULES = ("builtin", "accuracy", "code", "countdown", "length", "reward_model")


def _load_builtins() -> None:
    # importing the modules registers their rewards (reward_model imports transformers lazily)
    for module in BUILTIN_MODULES:
        importlib.import_module(f"grpo.rewards.{module}")


@dataclass
class RewardOutput:
    """per_function: [N, K] float32, NaN where a function returned None. errors: name -> count."""

    per_function: Tensor
    names: list[str]
    weights: Tensor
    errors: dict[str, int]

    @property
    def total(self) -> Tensor:
        """[N] weighted sum, None counted as 0."""
        return (torch.nan_to_num(self.per_function, nan=0.0) * self.weights).sum(dim=1)


def _name_of(spec: RewardSpec) -> str:
    return spec.name.rpartition(":")[2] if ":" in spec.name else spec.name


@dataclass
class _Call:
    """One submitted call: reward function k on completions idx. ``started`` is set by the
    worker thread, so a call's time limit counts from when it runs, not from when it queued."""

    k: int
    idx: list[int]
    future: Future | None = None
    started: float | None = None


class RewardRunner:
    """Scores completions with every configured function.

    Per completion (or per batch for ``batched`` functions) the call runs in a thread pool; a
    call that raises, returns a malformed value, or runs past ``timeout_s`` gives ``fallback``
    and is counted in ``errors``. The step's whole reward phase is also bounded: calls still
    queued when every slot has had its time are given up too. Threads cannot be killed, so after
    a step with an overrun the pool is replaced and the stuck thread is left to finish on its own
    (sandboxed code and math checks bound their own run time; only user functions can hang).
    """

    def __init__(self, config: RewardsConfig) -> None:
        self.config = config
        self.functions = [resolve_reward(spec) for spec in config.functions]
        self.names = [_name_of(spec) for spec in config.functions]
        if len(set(self.names)) != len(self.names):
            raise RewardError(f"rewards.functions: duplicate names in {self.names}")
        self.weights = torch.tensor([spec.weight for spec in config.functions], dtype=torch.float32)
        self.pool = self._new_pool()

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="reward")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for fn in self.functions:
            close = getattr(fn, "close", None)
            if callable(close):
                close()

    def _check(self, name: str, values: Any, expected: int) -> list[float | None]:
        if not isinstance(values, (list, tuple)) or len(values) != expected:
            raise RewardError(f"reward '{name}' must return a list of {expected} values")
        out = [None if v is None else float(v) for v in values]
        if any(v is not None and not math.isfinite(v) for v in out):
            raise RewardError(f"reward '{name}' returned a non-finite value")
        return out

    def _submit(self, call: _Call, fn: RewardFn, completions: list[str], kwargs: dict) -> None:
        def run() -> Any:
            call.started = time.monotonic()
            return fn(completions, **kwargs)

        call.future = self.pool.submit(run)

    def __call__(
        self,
        completions: list[str],
        prompts: list[Any],
        columns: dict[str, list[Any]],
        completion_ids: list[list[int]],
    ) -> RewardOutput:
        n = len(completions)
        kwargs = {**columns, "prompts": prompts, "completion_ids": completion_ids}
        scores = torch.full((n, len(self.functions)), math.nan, dtype=torch.float32)
        errors = dict.fromkeys(self.names, 0)
        calls: list[_Call] = []
        for k, fn in enumerate(self.functions):
            if getattr(fn, "batched", False):
                calls.append(_Call(k, list(range(n))))
                self._submit(calls[-1], fn, completions, kwargs)
                continue
            for i in range(n):
                calls.append(_Call(k, [i]))
                one = {key: [value[i]] for key, value in kwargs.items()}
                self._submit(calls[-1], fn, [completions[i]], one)
        limit = self.config.timeout_s
        # every worker slot gets `limit` per call it has to run, plus one limit of slack
        step_deadline = time.monotonic() + limit * (math.ceil(len(calls) / self.config.workers) + 1)
        waiting = {call.future: call for call in calls}
        overran = False
        while waiting:
            now = time.monotonic()
            expiries = [c.started + limit for c in waiting.values() if c.started is not None]
            wake = min([*expiries, step_deadline]) - now
            done, _ = wait(list(waiting), timeout=max(wake, 0.0), return_when=FIRST_COMPLETED)
            now = time.monotonic()
            for future in done:
                call = waiting.pop(future)
                values = self._result(call, errors)
                self._store(scores, call, values)
            for future, call in list(waiting.items()):
                late = now >= step_deadline or (
                    call.started is not None and now - call.started >= limit
                )
                if late:
                    future.cancel()
                    del waiting[future]
                    overran = True
                    errors[self.names[call.k]] += len(call.idx)
                    self._store(scores, call, [self.config.fallback] * len(call.idx))
        if overran:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = self._new_pool()
        return RewardOutput(scores, self.names, self.weights, errors)

    def _result(self, call: _Call, errors: dict[str, int]) -> list[float | None]:
        name = self.names[call.k]
        try:
            return self._check(name, call.future.result(), len(call.idx))
        except Exception:  # a reward that raises must not stop training; it is counted
            errors[name] += len(call.idx)
            return [self.config.fallback] * len(call.idx)

    @staticmethod
    def _store(scores: Tensor, call: _Call, values: list[float | None]) -> None:
        for i, v in zip(call.idx, values, strict=True):
            if v is not None:
                scores[i, call.k] = v
