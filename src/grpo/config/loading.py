"""Loading: YAML recipes plus dotted command-line overrides -> a validated ``Config``.

Bad input raises ``ConfigError`` with a one-line message naming the field or file.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from grpo.config.schema import Config, ConfigError, DataConfig, Section


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the config section at ``loc`` (a list index steps into the item type)."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        types = [field.annotation, *get_args(field.annotation)]
        model = next((t for t in types if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


def _all_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree."""
    out = []
    for name, field in (model or Config).model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            out += _all_keys(field.annotation, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def suggest_key(loc: tuple[Any, ...]) -> str | None:
    """The valid key closest to an unknown one: a sibling first, else any key with that name."""
    *section, name = [str(p) for p in loc]
    siblings = difflib.get_close_matches(name, _section_fields(tuple(loc[:-1])), n=1)
    if siblings:
        return ".".join([*section, siblings[0]])
    leaves = {key.rpartition(".")[2]: key for key in _all_keys()}
    close = difflib.get_close_matches(name, leaves, n=1)
    return leaves[close[0]] if close else None


def _format_validation_error(err: ValidationError) -> str:
    errors = err.errors()
    # a misspelt key also leaves its field "missing": name the misspelling
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        suggestion = suggest_key(tuple(first["loc"]))
        hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
        return f"unknown config key '{where}'{hint}; every key: grpo config --reference"
    if first["type"] == "string_type":  # YAML read 123, 2024-01-01 or on as another type
        kind = type(first.get("input")).__name__
        return (
            f"config '{where}': {first['msg']}, got a {kind} (values are read as YAML: quote "
            f"it, {where}='\"<value>\"' on the command line)"
        )
    return f"config '{where}': {first['msg']}"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`a.b=value` strings -> nested dict; values are parsed as YAML (numbers, lists, null)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def merge_trees(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``: a mapping merges key by key, anything else replaces; an empty
    mapping replaces too (``data.task_args={}`` clears the recipe's, where merging would keep it)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and value and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error: the later one would
    silently replace the earlier (a whole section, as often as a single value)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:  # as written: keys a merge (<<: *anchor) brings may repeat
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice", key_node.start_mark
                )
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)  # an unhashable key: its own error


def read_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte {err.start})") from None
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # a SafeLoader
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = err.problem or err.context or "invalid YAML"
        raise ConfigError(f"recipe {path}: invalid YAML at {where}: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections")
    return tree


def build_config(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(
    recipe: str | Path | None = None, overrides: list[str] | None = None, recorded: bool = False
) -> Config:
    """Recipe (or the default recipe) + dotted overrides -> validated Config.

    A recipe's relative paths are taken from its folder (``resolve_recipe_paths``), but for a
    ``recorded`` one: a run's own config.yaml, whose paths are as the run used them (from the
    working directory it ran in), already resolved.

    Overrides merge into the recipe key by key (``data.task_args.size=10`` keeps the recipe's
    other task_args), with two exceptions:

    - an override whose value is an empty mapping replaces the recipe's value
      (``data.task_args={}`` clears it);
    - an override that sets ``data.task`` to another task than the recipe's drops the recipe's
      task_args, which were for the recipe's task (``grpo train data.task=gsm8k`` on the default
      recipe); task_args given with it apply alone. The recipe's other keys stay.
    """
    path = Path(recipe) if recipe is not None else default_recipe_path()
    tree = read_recipe(path) if recorded else resolve_recipe_paths(read_recipe(path), path.parent)
    if "run_name" not in tree.get("train", {}):
        # a recipe's runs land in runs/<recipe name> unless it says otherwise
        tree = merge_trees(tree, {"train": {"run_name": path.stem}})
    extra = parse_overrides(overrides or [])
    return build_config(merge_trees(_drop_other_task_args(tree, extra), extra))


def _drop_other_task_args(tree: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``tree`` without its ``data.task_args`` when the overrides ``extra`` switch to another
    task: the recipe's were for its own task."""
    data, new = tree.get("data"), extra.get("data")
    if not isinstance(data, dict) or not isinstance(new, dict) or "task" not in new:
        return tree
    if "task_args" not in data:
        return tree
    if new["task"] == data.get("task", DataConfig.model_fields["task"].default):
        return tree
    return {**tree, "data": {k: v for k, v in data.items() if k != "task_args"}}


def resolve_recipe_paths(tree: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A recipe's relative file paths as paths from the recipe's folder, so a recipe runs the
    same from any working directory: data files, reward and environment files (`file.py:name`)
    and a model that is a folder or file next to the recipe (aliases and hub ids stay as they are).
    Command-line overrides stay relative to the working directory; so does train.output_dir."""

    def local(value: Any) -> Any:
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            return value
        return str(folder / value)

    tree = merge_trees(tree, {})
    data = tree.get("data")
    if isinstance(data, dict):
        tree["data"] = {**data, **{k: local(data[k]) for k in ("path", "eval_path") if k in data}}
    model = tree.get("model")
    if isinstance(model, dict) and isinstance(model.get("name"), str):
        candidate = folder / model["name"]
        if not Path(model["name"]).is_absolute() and candidate.exists():
            tree["model"] = {**model, "name": str(candidate)}
    rollout = tree.get("rollout")
    environment = rollout.get("environment") if isinstance(rollout, dict) else None
    if isinstance(environment, str) and ".py:" in environment:
        file, _, cls = environment.rpartition(":")
        tree["rollout"] = {**rollout, "environment": f"{local(file)}:{cls}"}
    rewards = tree.get("rewards")
    functions = rewards.get("functions") if isinstance(rewards, dict) else None
    if isinstance(functions, list):
        specs = []
        for spec in functions:
            name = spec.get("name") if isinstance(spec, dict) else None
            if isinstance(name, str) and ".py:" in name:
                file, _, fn = name.rpartition(":")
                spec = {**spec, "name": f"{local(file)}:{fn}"}
            specs.append(spec)
        tree["rewards"] = {**rewards, "functions": specs}
    return tree


def default_recipe_path() -> Path:
    return Path(__file__).parents[1] / "recipes" / "default.yaml"


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
