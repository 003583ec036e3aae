"""Parts a caller already holds: reward callables, a dataset, a model and its tokenizer, as a TRL
user passes them (``GRPOTrainer(model=..., reward_funcs=[fn], train_dataset=ds)``).

``grpo.train(config, rewards=[fn], dataset=ds, model=m, tokenizer=t)`` turns them into a
``Given`` and a config that records them: each callable becomes the reward spec
``module:qualname`` (its metrics are ``reward/<name>/...``), an environment class sets
``rollout.environment`` to its ``module:qualname``, a dataset sets ``data.task`` to none, a model sets ``model.name`` and ``model.dtype`` to its own. Resume fingerprints cover them
(``fingerprints``): a callable by its qualified name and source, a dataset by its rows, a model
by its weights, a tokenizer by its vocabulary and chat template, so a changed part under the same
name is refused, never resumed silently.

Callables run in the trainer's process, once per step with every completion (as TRL calls
them), on the reward threads: a timeout cannot kill them and no memory ceiling applies. For
that isolation, name a function as ``module:function`` in ``rewards.functions`` instead.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo.build import Given
from grpo.config import Config, ConfigError, RewardSpec, build_config
from grpo.data import DataError, Rows, first_rows, normalise_rows
from grpo.environments.classes import factory_spec
from grpo.rewards.registry import RewardFn

RewardItem = Callable[..., Sequence[float | None]] | str | dict[str, Any] | RewardSpec


class _Batched:
    """A caller's reward callable, called once with every completion of a step."""

    batched = True

    def __init__(self, fn: Callable[..., Sequence[float | None]]) -> None:
        self.fn = fn

    def __call__(self, completions: list[str], **columns: Any) -> list[float | None]:
        return list(self.fn(completions=completions, **columns))


ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _callee(fn: Callable[..., Any]) -> Any:
    """What a callable runs: a partial's function, a function or method itself, else the
    object's class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)


def spec_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of what a callable runs (a partial: its function; an object: its
    class)."""
    callee = _callee(fn)
    return f"{callee.__module__}:{callee.__qualname__}"


def _code_text(code: types.CodeType) -> str:
    """A compiled function, without the addresses its repr carries: its bytecode, names and
    constants, nested code objects (comprehensions, inner functions) taken apart the same way."""
    consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return repr((code.co_code, code.co_names, consts))


def source_digest(fn: Callable[..., Any]) -> str:
    """A fingerprint of what a callable computes, the same in every process: its source (else,
    defined where no source is kept, its compiled code), and what it closes over or is bound to
    (closure cells, default arguments, a partial's arguments, an object's attributes), by repr."""
    callee = _callee(fn)
    try:
        parts = [inspect.getsource(callee)]
    except (OSError, TypeError):
        target = vars(callee).get("__call__", callee) if isinstance(callee, type) else callee
        code = getattr(target, "__code__", None)
        parts = [_code_text(code) if code is not None else callee.__qualname__]
    while isinstance(fn, functools.partial):
        parts.append(repr((fn.args, sorted(fn.keywords.items()))))
        fn = fn.func
    if inspect.isfunction(fn):
        cells = [cell.cell_contents for cell in fn.__closure__ or ()]
        parts.append(repr((cells, fn.__defaults__, fn.__kwdefaults__)))
    elif not inspect.ismethod(fn):
        parts.append(repr(sorted(vars(fn).items())) if hasattr(fn, "__dict__") else "")
    # a repr may carry an object's address ("<function f at 0x7f...>"): not part of what it is
    text = ADDRESS.sub("", "\n".join(parts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def class_digest(cls: type) -> str:
    """A fingerprint of what a class does, the same in every process: the source of it and of
    its bases (else, defined where no source is kept, its methods' compiled code and its
    class-level constants)."""
    parts = []
    for klass in cls.__mro__[:-1]:  # not `object`
        try:
            parts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            members = sorted(vars(klass).items())
            code = [_code_text(v.__code__) for _, v in members if inspect.isfunction(v)]
            data = [f"{k}={_constant_text(v)}" for k, v in members if not k.startswith("__")]
            parts.append(klass.__qualname__ + "".join(code) + ";".join(data))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _constant_text(value: Any) -> str:
    """A class attribute as text that reads the same in every process: the repr of plain data
    (numbers, strings, and containers of them; a set's items sorted, since their order follows
    the process's hash seed), else only its type (a repr may hold a memory address)."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(map(_constant_text, value))})"
    text = repr(value)
    try:
        plain = ast.literal_eval(text) == value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        plain = False
    return text if plain else type(value).__qualname__


def weights_digest(model: nn.Module) -> str:
    """A fingerprint of a model's weights as ``model_digest`` takes a folder's, without reading
    gigabytes: every tensor's name, shape and dtype, and its first MiB of bytes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        head = tensor.detach().reshape(-1)[: (1 << 20) // tensor.element_size()]
        digest.update(head.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    text = repr((vocab, tokenizer.chat_template, tokenizer.all_special_tokens))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _rows_of(dataset: Any, config: Config, name: str, limit: int | None = None) -> Rows:
    if hasattr(dataset, "to_list"):  # a datasets.Dataset
        dataset = dataset.to_list()
    if not isinstance(dataset, list):
        raise DataError(
            f"{name}: a datasets.Dataset or a list of dicts, got {type(dataset).__name__}"
        )
    bad = next((i for i, row in enumerate(dataset) if not isinstance(row, dict)), None)
    if bad is not None:
        raise DataError(f"{name}: row {bad + 1} is a {type(dataset[bad]).__name__}, not a dict")
    data = config.data
    return first_rows(normalise_rows(dataset, data.prompt_field, data.answer_field, name), limit)


def _reward_spec(item: RewardItem) -> tuple[RewardSpec, RewardFn | None]:
    if isinstance(item, RewardSpec):
        return item, None
    if isinstance(item, str):
        return RewardSpec(name=item), None
    if isinstance(item, dict):
        return RewardSpec.model_validate(item), None
    if callable(item):
        return RewardSpec(name=spec_name(item)), _Batched(item)
    raise ConfigError(f"rewards: a callable, a reward name or a spec, got {type(item).__name__}")


def given_parts(
    config: Config,
    rewards: Sequence[RewardItem] | None = None,
    dataset: Any = None,
    eval_dataset: Any = None,
    model: nn.Module | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    environment: Callable[[], Any] | None = None,
) -> tuple[Config, Given]:
    """The config that records the given parts, and the parts (see the module docstring)."""
    tree = config.model_dump(mode="json")
    given = Given(model=model, tokenizer=tokenizer, environment=environment)
    if environment is not None:
        if not callable(environment):
            raise ConfigError(
                "environment: a class, or a callable that makes an instance (TRL's "
                f"environment_factory), got {type(environment).__name__}"
            )
        tree["rollout"]["environment"] = factory_spec(environment)  # a partial by its class
    if rewards is not None:
        specs = []
        for item in rewards:
            spec, fn = _reward_spec(item)
            specs.append(spec.model_dump())
            if fn is not None:
                given.rewards[spec.name] = fn
        tree["rewards"]["functions"] = specs
    if dataset is not None:
        tree["data"].update(task=None, path=None)
    if model is not None:
        dtypes = {p.dtype for p in model.parameters()}
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
        if len(dtypes) != 1 or next(iter(dtypes)) not in names:
            raise ConfigError(
                f"model: float32 or bfloat16 weights only, got {sorted(map(str, dtypes))}"
            )
        tree["model"].update(
            name=getattr(model, "name_or_path", "") or type(model).__name__,
            dtype=names[next(iter(dtypes))],
        )
    config = build_config(tree)
    if dataset is not None:
        given.rows = _rows_of(dataset, config, "dataset", config.data.num_examples)
    if eval_dataset is not None:
        given.eval_rows = _rows_of(eval_dataset, config, "eval_dataset")
    held_out = given.eval_rows is not None or config.data.eval_path is not None
    if given.rows is not None and config.train.eval_every and not held_out:
        raise DataError(
            "train.eval_every needs held-out rows: pass eval_dataset=..., set "
            "data.eval_path, or train.eval_every=0"
        )
    if model is not None and tokenizer is None and not getattr(model, "name_or_path", ""):
        raise ConfigError("model: pass its tokenizer too (tokenizer=...)")
    return config, given


def fingerprints(given: Given) -> dict[str, Any]:
    """What a checkpoint records of the given parts, to refuse a resume where one changed."""
    return {
        "rewards": {name: source_digest(fn.fn) for name, fn in given.rewards.items()} or None,
        "tokenizer": None if given.tokenizer is None else tokenizer_digest(given.tokenizer),
    }
