"""Environment classes written to TRL's ``environment_factory`` contract, run unchanged.

The contract (TRL's ``GRPOTrainer(environment_factory=...)``): a class with a no-argument
constructor; ``reset(**row)`` gets the dataset row's columns and returns None or text, which is
appended to the prompt's last message as it is; every public method (a name without a leading
underscore) is a tool, described to the model by the JSON schema ``transformers.utils.
get_json_schema`` makes of its signature and docstring (Google style, an ``Args:`` line per
parameter); the tool's return value, as ``str()`` writes it, is what the model sees next;
``get_reward()`` (optional) scores the finished episode. Here, as the issue asks and TRL does not:
``close()`` (optional) is called when the episode ends, and public methods without a docstring
are helpers, not tools (TRL would fail on them).

One instance per completion, made in the episode's ``start`` (``ClassEpisode``), where its
``reset`` runs with Python's, NumPy's and torch's global generators seeded from the prompt's
seed (and given back their state after): the G completions of a group get the same episode, and
a run with a seed repeats. Resets therefore run one at a time; tools run concurrently.

How the model calls a tool (``rollout.tool_call_format``):

- ``template``: the chat template's own syntax,
  ``<tool_call>{"name": "guess", "arguments": {"n": 50}}</tool_call>`` (Hermes, Qwen), with the
  tools listed in the prompt through the template (``tools=``);
- ``fence``: a fenced block ending the turn that holds one call written as Python,
  ````` ```\\nguess(50)\\n``` ````` or ``guess(n=50)`` (arguments are literals; any language tag).
  The prompt must describe the tools (nothing lists them).

A call that names no tool, or whose arguments do not fit the method's signature, is answered
with an error and never reaches the instance; a tool that raises is answered with the error
line (TRL does the same). Both count in ``env/errors``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import random
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.utils import get_json_schema

from grpo.config import ConfigError, RolloutConfig
from grpo.environments import Action, Step, ending_tool_call
from grpo.runtime.user_code import error_line, load_named

# lifecycle methods: the trainer calls them, the model does not
LIFECYCLE = ("reset", "get_reward", "close")
FENCE_RE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
# a fence's closing line ends the turn; its opening line ("```\n" at the turn's start, no tag
# needed) must not, or every call would cost the model a second request
STOPS = {"fence": ["\n```\n"], "template": ["</tool_call>"]}
# global generators are seeded around each reset: one reset at a time
SEEDED = threading.Lock()


def load_class(spec: str) -> Callable[[], Any]:
    """``path/to/file.py:ClassName`` or ``module:ClassName`` (or a factory function that returns
    an instance, as TRL's ``environment_factory`` may be); ConfigError (one line) if not."""
    where = f"rollout.environment={spec}"
    try:
        factory = load_named(spec, "ClassName")
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    if not callable(factory) or inspect.ismodule(factory):
        raise ConfigError(
            f"{where}: {spec.rpartition(':')[2]} is a {type(factory).__name__}, not a class or a "
            "function that makes an instance"
        )
    return factory


def factory_target(factory: Callable[..., Any]) -> Any:
    """What a factory calls: a partial's function or class, else the factory itself."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory


def factory_spec(factory: Callable[..., Any]) -> str:
    """``module:qualname`` of what a factory calls (a lambda or a local function gets a name
    that does not import again, as it cannot)."""
    target = factory_target(factory)
    module = getattr(target, "__module__", None) or "__main__"
    return f"{module}:{getattr(target, '__qualname__', type(target).__name__)}"


# parameters a JSON object of arguments cannot fill by name
UNNAMED = {
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
}


def tool_methods(instance: Any) -> dict[str, Callable[..., Any]]:
    """The instance's tools: its public methods with a docstring (static and class methods
    too), lifecycle methods aside. Read from the class without evaluating attributes: a property
    of an instance not yet reset may raise."""
    cls = type(instance)
    found = {}
    for name in dir(cls):
        if name.startswith("_") or name in LIFECYCLE:
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
            method = getattr(instance, name)
            if inspect.getdoc(method):
                found[name] = method
    return found


def named_parameters(where: str, method: Callable[..., Any]) -> inspect.Signature:
    """``method``'s signature, or ConfigError if a parameter cannot be given by name (the
    arguments of a call are a JSON object, or a call's keywords bound to names)."""
    signature = inspect.signature(method)
    unnamed = [
        f"{p.name} ({UNNAMED[p.kind]})" for p in signature.parameters.values() if p.kind in UNNAMED
    ]
    if unnamed:
        raise ConfigError(
            f"{where}: a tool's parameters are each named, with a type and a docstring line; "
            f"not {', '.join(unnamed)}"
        )
    return signature


def make_instance(factory: Callable[[], Any]) -> Any:
    """``factory()``, or ConfigError naming it (a constructor that needs arguments, or
    raises)."""
    try:
        return factory()
    except Exception as err:  # user code: any failure is one line
        raise ConfigError(
            f"rollout.environment: {factory_spec(factory).rpartition(':')[2]}() failed "
            f"({error_line(err)}); an "
            "environment class (or factory) is called without arguments"
        ) from None


@dataclass
class ClassEnvironment:
    """An environment class as an ``Environment``: ``cls`` (the class, or a factory that makes
    an instance, as TRL's ``environment_factory``) probed once here (called, the instance's
    ``reset`` and tools checked, the tools' schemas made), then one instance per episode."""

    cls: Callable[[], Any]
    call_format: str = "fence"
    # of a tool's answer: ``rollout.tool_max_output_chars``, its default where no config is
    max_output_chars: int = RolloutConfig.model_fields["tool_max_output_chars"].default
    kind: type = field(init=False)  # the instances' class
    name: str = field(init=False)
    tools: list[dict[str, Any]] = field(init=False)
    stop: list[str] = field(init=False)
    signatures: dict[str, inspect.Signature] = field(init=False)
    has_reward: bool = field(init=False)
    # resets take turns (the global generators are seeded around each): started one at a time
    serial_starts = True

    def __post_init__(self) -> None:
        probe = make_instance(self.cls)
        self.kind = type(probe)
        self.name = self.kind.__name__
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"rollout.environment: {self.name} has no reset method")
        methods = tool_methods(probe)
        if not methods:
            raise ConfigError(
                f"rollout.environment: {self.name} has no tools (public methods with a docstring)"
            )
        schemas = {}
        for name, method in methods.items():
            try:
                schemas[name] = get_json_schema(method)
            except Exception as err:  # transformers' schema errors (docstring, type hints)
                raise ConfigError(
                    f"rollout.environment: {self.name}.{name}: no tool schema ({error_line(err)})"
                ) from None
        self.signatures = {
            name: named_parameters(f"rollout.environment: {self.name}.{name}", method)
            for name, method in methods.items()
        }
        self.tools = list(schemas.values()) if self.call_format == "template" else []
        self.stop = STOPS[self.call_format]
        self.has_reward = callable(getattr(probe, "get_reward", None))  # optional, as in TRL
        # the probe had no episode, so it is not closed: a close() may need what reset() made

    def action(self, text: str) -> Action | None:
        parse = template_call if self.call_format == "template" else fence_call
        call = parse(text)
        if call is None or call.error is not None:
            return call
        name, given = call.call
        if name not in self.signatures:
            return Action(None, f"unknown tool '{name}' (tools: {', '.join(self.signatures)})")
        try:
            bound = self.signatures[name].bind(*given[0], **given[1])
        except TypeError as err:
            return Action(None, f"bad arguments for {name}: {err}")
        return Action({"name": name, "arguments": dict(bound.arguments)})

    def episode(self) -> ClassEpisode:
        return ClassEpisode(self.cls, self.max_output_chars)


def template_call(text: str) -> Action | None:
    """A ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` that ends the turn, as an
    action whose call is (name, (args, kwargs))."""
    found = ending_tool_call(text)
    if found is None:
        return None
    name, arguments = found
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return Action(None, 'a tool call is {"name": "...", "arguments": {...}}')
    return Action((name, ((), arguments)))


def fence_call(text: str) -> Action | None:
    """A fenced block ending the turn that holds one call, ``name(literal, key=literal)``, as an
    action whose call is (name, (args, kwargs))."""
    stripped = text.rstrip()
    match = next((m for m in FENCE_RE.finditer(stripped) if m.end() == len(stripped)), None)
    if match is None:
        return None
    try:
        node = ast.parse(match.group(1).strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a call")
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise ValueError("**arguments")
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return Action(None, "a call is one tool and its arguments as literals: name(1, key='x')")
    return Action((node.func.id, (args, kwargs)))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's global generators seeded from ``seed`` inside, their own
    state back after (the run's draws do not depend on what the environment drew)."""
    with SEEDED:
        states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.random.set_rng_state(states[2])


@dataclass
class ClassEpisode:
    """One instance of the class, for one completion."""

    cls: Callable[[], Any]
    max_output_chars: int
    instance: Any = None

    def start(self, row: dict[str, Any], seed: int) -> str | None:
        with seeded(seed):
            self.instance = self.cls()
            text = self.instance.reset(**row)
        if text is not None and not isinstance(text, str):
            raise TypeError(f"reset returned {type(text).__name__}, expected a string or None")
        return text

    def step(self, action: Action) -> Step:
        name, arguments = action.call["name"], action.call["arguments"]
        try:
            # the tool's return value, as str() writes it (a __str__ that raises counts too)
            output = str(getattr(self.instance, name)(**arguments))
        except Exception as err:  # the tool's own failure: shown to the model, as TRL does
            line = error_line(err)
            return Step(f"Error: {line}", "", line)
        if len(output) > self.max_output_chars:  # as the Python tool's: cut, said, counted
            error = f"output cut at {self.max_output_chars} characters"
            output = output[: self.max_output_chars]
            return Step(f"{output}\nError: {error}", output, error)
        return Step(output)

    def reward(self) -> Any:
        get_reward = getattr(self.instance, "get_reward", None)
        return get_reward() if callable(get_reward) else None

    def close(self) -> None:
        close = getattr(self.instance, "close", None)
        if callable(close):
            close()
