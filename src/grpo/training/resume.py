"""The resume decision, as a pure function of the run directory, the config and the inputs:
start fresh, resume from step N (with the config changes to announce), or refuse with the one
line to print. A resume whose config changes the math is refused unless ``train.resume=force``;
no resume changes the keys that decide which parameters exist.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo.build import Given
from grpo.config import Config, ConfigError
from grpo.config.diff import config_changes, describe_changes, flatten
from grpo.environments import Environment
from grpo.environments.classes import ClassEnvironment
from grpo.runs.directory import Checkpoint, RunDir, RunDirError, model_digest, rows_digest
from grpo.training.caller_parts import class_digest, source_digest, weights_digest
from grpo.training.caller_parts import fingerprints as given_fingerprints

# Keys that may change between a checkpoint and its resume: they change neither the math nor the
# order of the data (every train.* key except the seed, and pure memory/speed knobs). Precision
# rounds differently but optimises the same objective; `auto` measures again on resume, and on
# a machine that decides otherwise holding the old choice could make every step several times
# slower (bf16 on a CPU without bf16 units), so a change is said, not refused.
FREE_KEYS = {
    "model.gradient_checkpointing",
    "model.precision",
    "optim.micro_batch_size",
    "rollout.vllm_gpu_memory_utilization",
    "rewards.workers",
    # which held-out rows evaluation reads: training does not see them
    "data.eval_unseen",
    # where and how patiently generation elsewhere is reached: a run stopped because its
    # producer or server was lost resumes with a longer wait or a restarted server's address
    "rollout.producer_timeout_s",
    "rollout.server_url",
    "rollout.server_token",
    "rollout.server_timeout_s",
    "rollout.server_weights_host",
}

# Keys that decide which parameters exist, and so what a checkpoint's weights fit: no resume can
# change them, not even a forced one (a new run can start from the checkpoint's weights instead).
FIXED_KEYS = {"model.name", "model.lora.enabled", "model.lora.r", "model.lora.target_modules"}

# what a run's checkpoints fingerprint besides its config, and how a change is named
INPUTS = {
    "data": "the data's rows",
    "model": "the model folder's files",
    # grpo.train trains the model it is given in place: the same object passed again is the
    # trained model, and its weights would become the KL reference
    "given_model": "the given model's weights (grpo.train trains it in place: pass the model "
    "as first loaded)",
    "rewards": "the reward callables' source",
    "tokenizer": "the tokenizer's vocabulary or chat template",
    "environment": "the environment class's source",
    # its own key: checkpoints written before it lack it, and resume as they did
    "environment_file": "the environment class's file",
}


def fingerprints(
    config: Config,
    rows: list[dict[str, Any]],
    model_path: str | None,
    given: Given,
    environment: Environment | None = None,
) -> dict[str, Any]:
    """What a checkpoint records of a run's inputs (``INPUTS``): a task's rows follow from the
    config, which is compared anyway, but a file or a given dataset can change; a model folder
    by its files, a given model by its weights; given callables and tokenizer (``given``); an
    environment class by its source, given or named by a path whose file can change (a server's
    environment is out of reach)."""
    data = config.data.path is not None or given.rows is not None
    classed = isinstance(environment, ClassEnvironment)
    return {
        "data": rows_digest(rows) if data else None,
        "model": None if model_path is None else model_digest(model_path),
        "given_model": None if given.model is None else weights_digest(given.model),
        "environment": environment_digest(environment) if classed else None,
        "environment_file": environment_file_digest(environment)
        if classed and given.environment is None
        else None,
        **given_fingerprints(given),
    }


def environment_digest(environment: ClassEnvironment) -> str:
    """An environment class's fingerprint: its source and its bases', and a factory's with what
    it binds (``functools.partial(Wordle, length=5)``)."""
    digest = class_digest(environment.kind)
    if environment.cls is environment.kind:
        return digest
    return hashlib.sha256(f"{digest}\n{source_digest(environment.cls)}".encode()).hexdigest()[:16]


def environment_file_digest(environment: ClassEnvironment) -> str | None:
    """The whole file of a class the config names (``rollout.environment``), whose constants and
    helper functions the class may use; None where no file is kept. A class given from the
    library is not checked this way: its file is often the training script, edited between
    runs."""
    try:
        return hashlib.sha256(
            Path(inspect.getsourcefile(environment.kind) or "").read_bytes()
        ).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def input_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fingerprints that differ between a checkpoint (``old``) and this run (``new``), named
    for the user; one a side lacks (an older checkpoint, a hub id) is no change."""
    return {
        label: (old[key], new[key])
        for key, label in INPUTS.items()
        if old.get(key) and new.get(key) and old[key] != new[key]
    }


def changes_math(key: str) -> bool:
    """Whether changing ``key`` on resume changes what is computed or the order of the data."""
    if key.startswith("train."):
        return key == "train.seed"
    return key not in FREE_KEYS


def math_changes(
    old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None
) -> dict[str, tuple[Any, Any]]:
    """The changes a resume must not make silently: keys that change the math. A key a newer
    grpo added is compared with its default (see ``config_changes``), else left out: the user
    did not change it."""
    changes = config_changes(old, new, defaults)
    a, b = flatten(old), flatten(new)
    if defaults is None:
        changes = {k: v for k, v in changes.items() if k in a and k in b}

    def kept(key: str) -> bool:
        # a key only the old config has counts when a section above it is a value the new one
        # has ({} task_args lost max_number); else a newer grpo dropped it
        parts = key.split(".")
        return key in b or any(".".join(parts[:i]) in b for i in range(1, len(parts)))

    return {k: v for k, v in changes.items() if kept(k) and changes_math(k)}


def moot_change(key: str, change: tuple[Any, Any], new: dict[str, Any], same_model: bool) -> bool:
    """A config change that changes nothing: ``model.name`` naming a folder whose files are the
    same (moved or copied), LoRA's shape while LoRA is off, its target modules in another order."""
    old_value, new_value = change
    if key == "model.name":
        return same_model
    if key.startswith("model.lora.") and key != "model.lora.enabled":
        if not flatten(new).get("model.lora.enabled"):  # enabled is compared on its own
            return True
        lists = isinstance(old_value, list) and isinstance(new_value, list)
        return lists and sorted(old_value) == sorted(new_value)
    return False


@dataclass(frozen=True)
class ResumePlan:
    """Where a run starts: ``checkpoint`` None is a fresh start. ``changes`` holds every key the
    resume changes (for the history), ``forced`` those that change the math (train.resume=force)."""

    checkpoint: Checkpoint | None = None
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    forced: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return 0 if self.checkpoint is None else self.checkpoint.step


def plan_resume(run: RunDir, config: Config, world_size: int, inputs: dict[str, Any]) -> ResumePlan:
    """Pick the checkpoint to resume from ``run`` (locked by the caller) for ``config``, or
    refuse with ``ConfigError`` / ``RunDirError`` (one line). ``inputs`` are this run's
    fingerprints of the data and model (``INPUTS``)."""
    mode = config.train.resume
    if mode == "never":
        return ResumePlan()
    checkpoint = _checkpoint_to_resume(run, mode, world_size, config)
    if checkpoint is None:
        return ResumePlan()
    new = config.model_dump(mode="json")
    defaults = Config().model_dump(mode="json")
    forced = _math_changes(checkpoint, new, defaults, inputs)
    fixed = {key: change for key, change in forced.items() if key in FIXED_KEYS}
    if fixed:
        raise ConfigError(
            f"resuming {checkpoint.path}: {describe_changes(fixed)} cannot change on resume "
            "(the checkpoint's weights would not fit), not even with train.resume=force; "
            f"start a new run (train.run_name) with model.name={checkpoint.path}"
        )
    if checkpoint.step > config.train.steps:
        raise ConfigError(
            f"train.steps {config.train.steps} is below the step of {checkpoint.path} "
            f"({checkpoint.step}); raise it to train on"
        )
    if forced and mode != "force":
        how = (
            "set train.resume=force to apply the change, or train.resume=never to start over"
            if mode == "auto"
            else "a chosen checkpoint resumes with its own config: rewind to it first "
            f"(train.steps={checkpoint.step} and its config), then apply the change with "
            "train.resume=force"
        )
        raise ConfigError(
            f"resuming {checkpoint.path} with a config that changes the math: "
            f"{describe_changes(forced)}; {how}"
        )
    changes = {
        **config_changes(checkpoint.config, new, defaults),
        **input_changes(checkpoint.inputs, inputs),
    }
    return ResumePlan(checkpoint, changes, forced)


def _checkpoint_to_resume(
    run: RunDir, mode: str, world_size: int, config: Config
) -> Checkpoint | None:
    """The checkpoint ``train.resume`` (``auto``, ``force`` or a path) names in ``run``, or None
    for a fresh start; refused where the run directory or the world size does not fit it."""
    checkpoint = (
        run.latest_checkpoint() if mode in ("auto", "force") else run.checkpoint_at(Path(mode))
    )
    left = run.previous_run()
    if checkpoint is None:
        if left == ["metrics.jsonl"] and mode == "auto" and _stopped_before_saving(run, config):
            print(
                f"grpo: {run.path} holds the steps of a run of this config stopped before its "
                "first checkpoint: starting over (the same seed computes them again)",
                flush=True,
            )
            return None
        if left:  # a fresh start would delete them: the user decides
            raise RunDirError(
                f"{run.path} holds a run ({', '.join(left)}) with no checkpoint to resume; "
                "set train.resume=never to start over, or another train.run_name"
            )
        if mode == "force":
            raise ConfigError(f"train.resume=force: no checkpoint in {run.checkpoints}")
        return None
    if not checkpoint.path.resolve().is_relative_to(run.checkpoints.resolve()) and left:
        raise RunDirError(
            f"train.resume: {checkpoint.path} is another run's checkpoint and {run.path} "
            f"holds a run of its own ({', '.join(left)}); set another train.run_name"
        )
    if checkpoint.world_size != world_size:
        raise ConfigError(
            f"checkpoint {checkpoint.path} was written by {checkpoint.world_size} process(es); "
            f"resume it with the same number (this run has {world_size})"
        )
    return checkpoint


def _stopped_before_saving(run: RunDir, config: Config) -> bool:
    """Whether the run ``run`` recorded (its ``config.yaml``) computes what ``config`` does: then
    its steps, logged before any checkpoint, are what a fresh start of ``config`` logs again."""
    try:
        recorded = yaml.safe_load((run.path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(recorded, dict):
        return False
    new, defaults = config.model_dump(mode="json"), Config().model_dump(mode="json")
    return not math_changes(recorded, new, defaults)


def _math_changes(
    checkpoint: Checkpoint, new: dict[str, Any], defaults: dict[str, Any], inputs: dict[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """What resuming ``checkpoint`` with the config ``new`` and ``inputs`` changes of the math:
    config keys (but moot ones) and changed inputs."""
    same_model = (
        inputs.get("model") is not None and checkpoint.inputs.get("model") == inputs["model"]
    )
    forced = {
        key: change
        for key, change in math_changes(checkpoint.config, new, defaults).items()
        if not moot_change(key, change, new, same_model)
    }
    forced.update(input_changes(checkpoint.inputs, inputs))
    return forced


def open_run(run: RunDir, plan: ResumePlan, config_text: str) -> None:
    """Rank 0: the run directory as this run continues it (config, history, logs), each change
    said on the console in one line."""
    checkpoint, step = plan.checkpoint, plan.step
    if checkpoint is None:
        run.start_fresh()
    else:
        removed = run.rewind(step)  # before the logs: see its docstring
        run.prepare_logs(step)
        where = (
            checkpoint.path.relative_to(run.path)
            if checkpoint.path.is_relative_to(run.path)
            else checkpoint.path
        )
        print(f"grpo: resuming from {checkpoint.path} (step {checkpoint.step})", flush=True)
        if removed:
            print(f"grpo: removed what followed step {step}: {', '.join(removed)}")
        run.log_event(step, "resume", checkpoint=str(where))
        if plan.forced:
            print(
                f"grpo: train.resume=force: from step {step} {describe_changes(plan.forced)}",
                flush=True,
            )
        free = {k: v for k, v in plan.changes.items() if k not in plan.forced}
        if free:
            print(f"grpo: from step {step} {describe_changes(free)}", flush=True)
    event = "start" if checkpoint is None else "resume"
    run.record_config(config_text, step, event, plan.changes)
