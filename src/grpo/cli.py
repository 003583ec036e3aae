"""Command line: ``grpo train | eval | report | models | tasks | config``.

Bad input (config, data, rewards, model names) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from grpo.config import ConfigError, load_config


def _user_errors() -> tuple[type[BaseException], ...]:
    from grpo.data import DataError
    from grpo.models import ModelError
    from grpo.rewards import RewardError

    return (ConfigError, DataError, ModelError, RewardError, FileNotFoundError)


def cmd_train(args: argparse.Namespace) -> int:
    from grpo.trainer import train

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        recipe, overrides = None, [recipe, *overrides]
    config = load_config(recipe, overrides)
    run_dir = train(config)
    print(f"run finished: {run_dir}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from grpo.config import dump_config

    print(dump_config(load_config(args.recipe, list(args.overrides))), end="")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from grpo.models import ALIASES, cache_root, is_cached

    for name in ALIASES:
        print(f"{name:28s} {'cached' if is_cached(name) else 'not cached'}")
    print(f"cache: {cache_root()}")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from grpo.data.tasks import TASKS

    for name, task in sorted(TASKS.items()):
        print(f"{name:14s} {task.description}  [rewards: {', '.join(task.default_rewards)}]")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": cmd_train,
    "config": cmd_config,
    "models": cmd_models,
    "tasks": cmd_tasks,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train with a recipe (default: the built-in one)")
    train.add_argument("recipe", nargs="?", help="YAML recipe")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=16")
    config = sub.add_parser("config", help="print the resolved config")
    config.add_argument("recipe", nargs="?")
    config.add_argument("overrides", nargs="*")
    sub.add_parser("models", help="list model aliases and whether each is cached")
    sub.add_parser("tasks", help="list built-in tasks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return COMMANDS[args.command](args)
    except _user_errors() as err:
        print(f"grpo: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
