"""reasoning-gym's procedural generators as a task (``data.task: reasoning_gym``): rows from a
generator (or a weighted mix) by seed, and their difficulty levels for ``data.curriculum``.

The package is an optional extra (``pip install 'grpo[reasoning-gym]'``), imported only when a
run uses it. ``data.task_args``: ``name`` and ``config`` (one generator and its config
dataclass's fields), or ``datasets: [{name, weight, config}, ...]`` (a mix, reasoning-gym's own
``CompositeDataset``), and ``size`` (rows per split). Each split's rows come from a seed range of
its own: reasoning-gym draws item ``i`` of a dataset seeded ``s`` from ``Random(s + i)``, so train
and held-out rows never share a seed (a question may still repeat where a generator has few).

A row: ``prompt`` (the question), ``answer`` (the oracle answer; None where ``score_answer``
judges by rule, e.g. ``graph_color``) and ``reasoning_gym``: the generator's name, its config and
the whole entry, which the ``reasoning_gym`` reward scores with the generator's own
``score_answer`` (``grpo.rewards.reasoning_gym``).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "test", "validation")
# a split's seeds: [base, base + SEED_SPAN); a run draws at most SEED_SPAN rows of one split
SEED_SPAN = 2**26


class GymError(ValueError):
    """A generator, config or level that cannot be used; one line naming it."""


def package() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise GymError(
            "data.task reasoning_gym needs the reasoning-gym package: "
            "pip install 'grpo[reasoning-gym]' (Python >= 3.11)"
        ) from None
    return reasoning_gym


def registry() -> dict[str, tuple[type, type]]:
    """Generator name -> (dataset class, config dataclass)."""
    package()
    from reasoning_gym.factory import DATASETS

    return {name: classes for name, classes in DATASETS.items() if name != "composite"}


def curricula() -> dict[str, type]:
    """Generator name -> its reasoning-gym curriculum class (most generators have one)."""
    package()
    from reasoning_gym.factory import CURRICULA

    return dict(CURRICULA)


def split_seed(split: str, seed: int) -> int:
    """The first reasoning-gym seed of ``split``'s rows; below 2**32 (numpy seeds some)."""
    if split not in SPLITS:
        raise GymError(f"split must be one of {', '.join(SPLITS)}, got '{split}'")
    slot = seed * len(SPLITS) + SPLITS.index(split)
    return (slot * SEED_SPAN) % 2**32


def check_name(name: Any) -> str:
    """``name`` when reasoning-gym has that generator; else GymError naming the closest ones."""
    known = registry()
    if isinstance(name, str) and name in known:
        return name
    close = difflib.get_close_matches(str(name), list(known), n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise GymError(
        f"reasoning_gym: no generator '{name}'{hint} (all {len(known)}: grpo tasks reasoning_gym)"
    )


# set by grpo, never by a config: the seed from train.seed and the split, the size from task_args
OWN_FIELDS = ("seed", "size")


def checked_config(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` when ``name``'s config dataclass takes it and its ``validate`` passes;
    else GymError naming the key or the setting out of range."""
    config_cls = registry()[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in OWN_FIELDS]
    for key in config:
        if key in OWN_FIELDS:
            raise GymError(
                f"reasoning_gym '{name}': config.{key} is set by grpo "
                "(seed: train.seed and the split; size: task_args.size)"
            )
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise GymError(
                f"reasoning_gym '{name}': no config key '{key}'{hint}; it has: {', '.join(fields)}"
            )
    try:
        made = config_cls(**config)
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, ValueError, TypeError) as err:
        said = " ".join(str(err).split()) or type(err).__name__
        raise GymError(f"reasoning_gym '{name}': config {config} is out of range: {said}") from None
    return config


@dataclass(frozen=True)
class Generator:
    """One generator of a task: its name, weight in a mix, and config (without seed and size)."""

    name: str
    weight: float
    config: dict[str, Any]


def generators(
    name: str | None = None,
    config: dict[str, Any] | None = None,
    datasets: list[dict[str, Any]] | None = None,
) -> list[Generator]:
    """The task's generators from ``data.task_args``: one (``name``, ``config``) or a mix
    (``datasets``), each checked against reasoning-gym."""
    if (name is None) == (datasets is None):
        raise GymError("reasoning_gym: set task_args.name (one generator) or task_args.datasets")
    if name is not None:
        return [Generator(check_name(name), 1.0, checked_config(name, dict(config or {})))]
    if config is not None:
        raise GymError("reasoning_gym: with task_args.datasets, each dataset has its own config")
    if not isinstance(datasets, list) or not datasets:
        raise GymError("reasoning_gym: task_args.datasets is a list of {name, weight, config}")
    out = []
    for i, spec in enumerate(datasets):
        extra = set(spec) - {"name", "weight", "config"} if isinstance(spec, dict) else {"?"}
        if extra or "name" not in spec:
            raise GymError(f"reasoning_gym: task_args.datasets[{i}] takes name, weight, config")
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or not weight > 0:
            raise GymError(f"reasoning_gym: task_args.datasets[{i}].weight must be > 0")
        gen = check_name(spec["name"])
        out.append(Generator(gen, float(weight), checked_config(gen, dict(spec.get("config", {})))))
    if len({g.name for g in out}) != len(out):
        raise GymError("reasoning_gym: a generator appears twice in task_args.datasets")
    return out


def dataset(gens: list[Generator], seed: int, size: int) -> Any:
    """The reasoning-gym dataset of ``gens`` (a ``CompositeDataset`` for a mix)."""
    rg = package()
    if len(gens) == 1:
        return rg.create_dataset(gens[0].name, **gens[0].config, seed=seed, size=size)
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    specs = [DatasetSpec(g.name, g.weight, dict(g.config)) for g in gens]
    return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))


def as_row(entry: dict[str, Any], gens: list[Generator]) -> dict[str, Any]:
    """A task row from a reasoning-gym entry; ``reasoning_gym`` holds what scoring it needs."""
    name = entry["metadata"]["source_dataset"]
    config = next(g.config for g in gens if g.name == name)
    return {
        "prompt": entry["question"],
        "answer": entry["answer"],
        "reasoning_gym": {"dataset": name, "config": config, "entry": entry},
    }


def reasoning_gym_rows(
    split: str = "train",
    seed: int = 0,
    size: int = 1000,
    name: str | None = None,
    config: dict[str, Any] | None = None,
    datasets: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``size`` rows of ``split`` from the generator(s) (see the module docstring)."""
    if not isinstance(size, int) or not 1 <= size <= SEED_SPAN:
        raise GymError(f"reasoning_gym: task_args.size must be 1 to {SEED_SPAN}, got {size}")
    gens = generators(name, config, datasets)
    data = dataset(gens, split_seed(split, seed), size)
    return [as_row(data[i], gens) for i in range(size)]


# ---------------------------------------------------------------------------- levels


def moving_attributes(name: str, chosen: list[str] | None) -> list[Any]:
    """The attributes of ``name``'s reasoning-gym curriculum that move with the level:
    ``chosen`` (those it has), else all."""
    known = curricula()
    if name not in known:
        raise GymError(
            f"data.curriculum: reasoning-gym has no curriculum for '{name}' "
            "(set data.curriculum.levels)"
        )
    attrs = known[name]().attributes
    if chosen is None:
        return list(attrs.values())
    return [attrs[a] for a in chosen if a in attrs]


def top_level(name: str, chosen: list[str] | None) -> int:
    """The last level of ``name``'s curriculum: its longest moving attribute's."""
    return max((len(a.levels) - 1 for a in moving_attributes(name, chosen)), default=0)


def level_config(name: str, base: dict[str, Any], level: int, chosen: list[str] | None) -> dict:
    """``base`` with each moving attribute at ``level`` (its last level where it has fewer), as
    reasoning-gym's curriculum sets it: a range attribute spans its first level to this one."""
    from reasoning_gym.coaching.attributes import RangeAttributeDefinition
    from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext

    curriculum = curricula()[name]()
    context = DefaultCurriculumContext()
    config = dict(base)
    for attr in moving_attributes(name, chosen):
        curriculum.set_attr_level(attr.name, min(level, len(attr.levels) - 1))
        value = context.get_attr_value(curriculum, attr)
        if isinstance(attr, RangeAttributeDefinition):
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            config[attr.lower_field_name] = min(values)
            config[attr.upper_field_name] = max(values)
        else:
            config[attr.field_name] = value
    return config
