"""The registry of reward functions by name: built-ins register themselves when their module is
imported, and the registry imports those modules the first time a name is looked up (its only
job: so that nothing imports a built-in before it is needed, and no import cycle remains).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from grpo.config import RewardSpec
from grpo.rewards._reward_worker import load_function

RewardFn = Callable[..., list[float | None]]

# name -> constructor taking the spec's `args` and returning a reward function
REGISTRY: dict[str, Callable[..., RewardFn]] = {}
# name -> what a built-in pays for, where that is one of REWARD_KINDS (the hacking watch compares
# format rewards with accuracy rewards: grpo.training.hack_watch)
KINDS: dict[str, str] = {}
REWARD_KINDS = ("format", "accuracy")
# name -> "module:factory" of a built-in that runs in the user functions' worker processes (its
# work is third-party code that may hang): each worker calls the factory with the spec's args
IN_WORKERS: dict[str, str] = {}


VERIFIERS_PREFIX = "verifiers:"  # verifiers:NAME, the reward NAME of the rows' verifiers tasks


class RewardError(ValueError):
    """A reward function that cannot be set up; one line for the user."""


def register(
    name: str, kind: str | None = None
) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Register a reward factory under ``name``; ``kind`` says what it pays for, when it is one
    of ``REWARD_KINDS`` ("format": the shape of the answer; "accuracy": its correctness)."""
    if kind is not None and kind not in REWARD_KINDS:
        raise ValueError(f"reward kind must be one of {REWARD_KINDS}, got {kind!r}")

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        REGISTRY[name] = factory
        if kind is not None:
            KINDS[name] = kind
        return factory

    return wrap


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a reward this process runs itself (a built-in or a verifiers one)
    rather than a user function run in the worker processes."""
    load_builtins()
    return name in REGISTRY or name.startswith(VERIFIERS_PREFIX)


def register_in_workers(
    name: str, kind: str | None = None
) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """``register``, for a built-in whose calls run in worker processes, as user functions'
    do: bounded by ``rewards.timeout_s``, the worker killed and replaced when one overruns."""

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        register(name, kind)(factory)
        IN_WORKERS[name] = f"{factory.__module__}:{factory.__name__}"
        return factory

    return wrap


def registered_kind(name: str) -> str | None:
    """The kind a built-in reward was registered with (None: another, or not a built-in)."""
    load_builtins()
    return KINDS.get(name)


def resolve_reward(spec: RewardSpec) -> RewardFn:
    """A built-in (constructed with spec.args), or a user function by module:fn / file.py:fn."""
    load_builtins()
    if spec.name in REGISTRY:
        try:
            return REGISTRY[spec.name](**spec.args)
        except TypeError as err:
            raise RewardError(f"reward '{spec.name}': bad args {spec.args}: {err}") from None
    if spec.name.startswith(VERIFIERS_PREFIX):  # one reward of a verifiers taskset
        from grpo.rewards.verifiers import verifiers_reward

        return verifiers_reward(spec.name.removeprefix(VERIFIERS_PREFIX), **spec.args)
    if ":" in spec.name:
        check_user_spec(spec)
        try:
            return load_function(spec.name)
        except ValueError as err:
            raise RewardError(f"reward '{spec.name}': {err}") from None
    known = ", ".join(sorted(REGISTRY))
    raise RewardError(f"unknown reward '{spec.name}' (built-ins: {known}; or module:function)")


def check_user_spec(spec: RewardSpec) -> None:
    if spec.args:
        raise RewardError(f"reward '{spec.name}': args are only for built-in rewards")


BUILTIN_MODULES = (
    "builtin",
    "accuracy",
    "code",
    "countdown",
    "environment",
    "length",
    "verifiers",
    "reward_model",
    "reasoning_gym",
)


def load_builtins() -> None:
    # importing the modules registers their rewards (reward_model imports transformers lazily)
    for module in BUILTIN_MODULES:
        importlib.import_module(f"grpo.rewards.{module}")
