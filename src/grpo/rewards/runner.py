"""The reward runner: every configured function scored on a step's completions (built-ins in
threads, user functions in worker processes), each failure counted and shown once, and the
watch that stops a run whose reward keeps failing."""

from __future__ import annotations

import inspect
import math
import sys
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo.config import RewardsConfig, RewardSpec
from grpo.rewards._reward_worker import check_values
from grpo.rewards.pool import WorkerPool, WorkerStartError
from grpo.rewards.registry import (
    IN_WORKERS,
    RewardError,
    RewardFn,
    check_user_spec,
    is_builtin,
    load_builtins,
    resolve_reward,
)

# the column of live environment instances (grpo.rewards.inputs): for this process only
LIVE = "environments"


def takes_environments(fn: RewardFn) -> bool:
    """Whether ``fn`` names a parameter ``environments`` (then it reads live instances)."""
    try:
        return LIVE in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return False


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
        return weighted_total(self.per_function, self.weights)


def weighted_total(per_function: Tensor, weights: Tensor) -> Tensor:
    """per_function: [N, K] (NaN for None), weights: [K] -> [N] weighted sum, None counted as 0."""
    return (torch.nan_to_num(per_function, nan=0.0) * weights).sum(dim=1)


def function_name(spec: RewardSpec) -> str:
    """The name a reward function's metrics carry: a built-in's, or a user function's own."""
    return spec.name.rpartition(":")[2] if ":" in spec.name else spec.name


class RewardFailure(RewardError):
    """A reward function failed on too many completions for too many steps: the run stops."""


class RewardRunner:
    """Scores completions with every configured function, and makes every failure seen.

    Built-ins run in this process on ``workers`` threads, one call per completion (``batched``
    ones once per step); each bounds its own work (math-verify in killable worker processes, code
    in the sandbox, the rest are pure and cheap). User functions (module:fn, file.py:fn), and
    built-ins registered to (``register_in_workers``: ``reasoning_gym``), run in a
    ``WorkerPool`` of ``workers`` processes, one call per completion; a step's calls all end
    within ``timeout_s`` of the phase's start: still running then, a call is stopped by killing
    its worker. A call that raises, returns a malformed value, times out or is killed for memory
    scores ``fallback`` and is counted in ``errors``; the first failure of each kind of each
    function is printed with its traceback or reason.
    """

    def __init__(
        self,
        config: RewardsConfig,
        given: dict[str, RewardFn] | None = None,
        live_environments: bool = False,
    ) -> None:
        """``given``: spec name -> a callable the caller holds, run in this process.
        ``live_environments``: the rollouts' episodes carry live environment instances (the
        column ``environments``, TRL's): a user function with a parameter named
        ``environments`` runs in this process too, on the reward threads (an instance cannot
        cross into a worker process); the worker processes never receive the column."""
        given = dict(given or {})
        if live_environments:
            for spec in config.functions:
                if not is_builtin(spec.name) and spec.name not in given and ":" in spec.name:
                    fn = resolve_reward(spec)
                    if takes_environments(fn):
                        given[spec.name] = fn
        self.config = config
        self.names = [function_name(spec) for spec in config.functions]
        if len(set(self.names)) != len(self.names):
            raise RewardError(f"rewards.functions: duplicate names in {self.names}")
        self.weights = torch.tensor([spec.weight for spec in config.functions], dtype=torch.float32)
        load_builtins()
        user = [
            k
            for k, spec in enumerate(config.functions)
            if spec.name not in given and (not is_builtin(spec.name) or spec.name in IN_WORKERS)
        ]
        self.builtins = {
            k: given[spec.name] if spec.name in given else resolve_reward(spec)
            for k, spec in enumerate(config.functions)
            if k not in user
        }
        # built-ins run in the workers: made here once too, so bad args fail now, in one line
        self.in_workers = {
            k: resolve_reward(config.functions[k])
            for k in user
            if config.functions[k].name in IN_WORKERS
        }
        for k in user:
            if k in self.in_workers:
                continue
            if ":" not in config.functions[k].name:
                resolve_reward(config.functions[k])  # the "unknown reward" error
            check_user_spec(config.functions[k])
        self.user = user  # pool function index j runs config.functions[user[j]]
        self.threads = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="reward")
        self.pool = None
        if user:
            specs = [config.functions[k] for k in user]
            try:
                self.pool = WorkerPool(
                    [IN_WORKERS.get(spec.name, spec.name) for spec in specs],
                    config.workers,
                    config.max_worker_rss_mb,
                    args=[spec.args if spec.name in IN_WORKERS else None for spec in specs],
                )
            except WorkerStartError as err:
                self.close()
                raise RewardError(str(err)) from None
        self.reported: set[tuple[str, str]] = set()

    def check_columns(self, rows: list[dict[str, Any]]) -> None:
        """A built-in reads columns (``columns``) without which it scores None for every
        completion: a column no row has is an error now, not a reward that never counts."""
        present = {key for row in rows for key in row}
        for k, fn in {**self.builtins, **self.in_workers}.items():
            for column in getattr(fn, "columns", ()):
                if column not in present:
                    raise RewardError(
                        f"reward '{self.names[k]}' reads the column '{column}', which no row of "
                        "the data has (its gold answers: data.answer_field; tests: the "
                        "reward's tests_field)"
                    )

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None:
            self.pool.close()
        for fn in [*self.builtins.values(), *self.in_workers.values()]:
            close = getattr(fn, "close", None)
            if callable(close):
                close()

    def __call__(
        self,
        completions: list[str],
        prompts: list[Any],
        columns: dict[str, list[Any]],
        completion_ids: list[list[int]],
    ) -> RewardOutput:
        n = len(completions)
        kwargs = {**columns, "prompts": prompts, "completion_ids": completion_ids}
        rows = [{key: [value[i]] for key, value in kwargs.items()} for i in range(n)]
        scores = torch.full((n, len(self.names)), math.nan, dtype=torch.float32)
        errors = dict.fromkeys(self.names, 0)
        threaded: list[tuple[int, list[int], Future]] = []
        for k, fn in self.builtins.items():
            if getattr(fn, "batched", False):
                threaded.append((k, list(range(n)), self.threads.submit(fn, completions, **kwargs)))
                continue
            for i in range(n):
                future = self.threads.submit(fn, [completions[i]], **rows[i])
                threaded.append((k, [i], future))
        if self.pool is not None:
            # a batched function's one call first; the others completion-major, so one slow
            # function does not hold back the others' first calls
            batched = self.pool.batched
            which = [(j, list(range(n))) for j in range(len(self.user)) if batched[j]]
            which += [(j, [i]) for i in range(n) for j in range(len(self.user)) if not batched[j]]
            calls = [
                (
                    j,
                    [completions[i] for i in idx],
                    {key: [v[i] for i in idx] for key, v in kwargs.items() if key != LIVE},
                )
                for j, idx in which
            ]
            outcomes = self.pool.run(calls, self.config.timeout_s)
            for (j, idx), outcome in zip(which, outcomes, strict=True):
                k = self.user[j]
                if outcome.recycled:
                    limit = self.config.max_worker_rss_mb
                    self._report(
                        k, "recycled", f"passed rewards.max_worker_rss_mb={limit:g} after a call"
                    )
                if outcome.kind == "ok":
                    self._store(scores, k, idx, outcome.values)
                else:
                    self._fail(scores, errors, k, idx, outcome.kind, outcome.detail)
        for k, idx, future in threaded:
            try:
                values = future.result()
            except Exception:  # a built-in that raises must not stop training; it is counted
                self._fail(scores, errors, k, idx, "raised", traceback.format_exc())
                continue
            try:
                self._store(scores, k, idx, check_values(self.names[k], values, len(idx)))
            except ValueError as err:
                self._fail(scores, errors, k, idx, "bad", str(err))
        unscored = int(scores.isnan().all(dim=1).sum()) if len(self.names) else 0
        if unscored and ("", "none") not in self.reported:  # TRL warns of these too
            self.reported.add(("", "none"))
            print(
                f"rewards: every function returned None for {unscored} of {n} completions, "
                "which score a total reward of 0 (said once; counted per step in "
                "reward/unscored_frac)",
                file=sys.stderr,
                flush=True,
            )
        return RewardOutput(scores, self.names, self.weights, errors)

    def _fail(
        self, scores: Tensor, errors: dict[str, int], k: int, idx: list[int], kind: str, detail: str
    ) -> None:
        errors[self.names[k]] += len(idx)
        self._store(scores, k, idx, [self.config.fallback] * len(idx))
        self._report(k, kind, detail)

    def _report(self, k: int, kind: str, detail: str) -> None:
        """Print the first failure of each kind of each function (later ones are counted)."""
        name = self.names[k]
        if (name, kind) in self.reported:
            return
        self.reported.add((name, kind))
        later = "later ones are counted per step"
        line = {
            "raised": f"reward '{name}' raised (its first error; {later}):\n{detail.rstrip()}",
            "bad": f"{detail} (its first malformed value; {later})",
            "timeout": f"reward '{name}': {detail} (first time; {later})",
            "memory": f"reward '{name}': {detail} (first time; {later})",
            "died": f"reward '{name}': {detail} (first time; {later})",
            "recycled": f"reward '{name}': its worker {detail}, so it was replaced",
        }[kind]
        print(line, file=sys.stderr, flush=True)

    @staticmethod
    def _store(scores: Tensor, k: int, idx: list[int], values: list[float | None]) -> None:
        for i, v in zip(idx, values, strict=True):
            if v is not None:
                scores[i, k] = v


class ErrorWatch:
    """Per step: one console line with each function's error count, and the stop rule: a function
    that fails on more than ``max_frac`` of a step's completions ``patience`` steps in a row
    stops the run with ``RewardFailure``. ``what`` the functions are: rewards, or an
    environment (its failed episodes)."""

    def __init__(self, max_frac: float, patience: int, what: str = "reward") -> None:
        self.max_frac = max_frac
        self.patience = patience
        self.what = what
        self.streak: dict[str, int] = {}

    def observe(self, step: int, errors: dict[str, int], completions: int, announce: bool) -> None:
        failing = {name: count for name, count in errors.items() if count}
        if failing and announce:
            counts = ", ".join(f"{name} {count}/{completions}" for name, count in failing.items())
            print(f"step {step}: {self.what} errors: {counts}", file=sys.stderr, flush=True)
        for name, count in errors.items():
            over = count > self.max_frac * completions
            self.streak[name] = self.streak.get(name, 0) + 1 if over else 0
            if self.streak[name] >= self.patience:
                raise RewardFailure(
                    f"{self.what} '{name}' failed on more than rewards.max_error_frac="
                    f"{self.max_frac:g} of the completions for {self.patience} steps in a row "
                    f"(step {step}: {count}/{completions}); its first error is printed above"
                )
