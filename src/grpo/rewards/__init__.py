"""Reward functions: the protocol, the registry of built-ins, and the runner.

A reward function is any callable
``f(completions: list[str], *, prompts: list, completion_ids: list[list[int]], **columns)
-> list[float | None]``: dataset columns arrive as keyword lists aligned with ``completions``;
``None`` means "not applicable" (excluded from that function's mean, weighted as 0).
Functions with a true ``batched`` attribute get the whole batch in one call (a reward model);
the others are called one completion at a time in a thread pool, so slow verifiers overlap and
one failing completion falls back alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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


def _load_builtins() -> None:
    # importing the modules registers their rewards
    from grpo.rewards import builtin  # noqa: F401


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


class RewardRunner:
    """Scores completions with every configured function, with per-call timeout and fallback."""

    def __init__(self, config: RewardsConfig) -> None:
        self.config = config
        self.functions = [resolve_reward(spec) for spec in config.functions]
        self.names = [_name_of(spec) for spec in config.functions]
        if len(set(self.names)) != len(self.names):
            raise RewardError(f"rewards.functions: duplicate names in {self.names}")
        self.weights = torch.tensor([spec.weight for spec in config.functions], dtype=torch.float32)
        self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="reward")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _check(self, name: str, values: Any, expected: int) -> list[float | None]:
        if not isinstance(values, (list, tuple)) or len(values) != expected:
            raise RewardError(f"reward '{name}' must return a list of {expected} values")
        return [None if v is None else float(v) for v in values]

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
        pending: list[tuple[int, list[int], Future]] = []
        for k, fn in enumerate(self.functions):
            if getattr(fn, "batched", False):
                pending.append((k, list(range(n)), self.pool.submit(fn, completions, **kwargs)))
                continue
            for i in range(n):
                one = {key: [value[i]] for key, value in kwargs.items()}
                pending.append((k, [i], self.pool.submit(fn, [completions[i]], **one)))
        for k, idx, future in pending:
            name = self.names[k]
            try:
                values = self._check(name, future.result(timeout=self.config.timeout_s), len(idx))
            except (FutureTimeout, RewardError):
                future.cancel()
                values = [self.config.fallback] * len(idx)
                errors[name] += len(idx)
            except Exception:  # a user reward that raises must not stop training; it is counted
                values = [self.config.fallback] * len(idx)
                errors[name] += len(idx)
            for i, v in zip(idx, values, strict=True):
                if v is not None:
                    scores[i, k] = v
        return RewardOutput(scores, self.names, self.weights, errors)
