"""Metric sinks and the progress bar.

``metrics.jsonl`` is always written (one JSON object per step); tensorboard by default; wandb and
trackio when installed, in offline mode. Only the process that owns the run directory logs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Self-check phrases: the "aha moment" behaviour the GRPO papers report emerging with training.
REFLECTION_RE = re.compile(
    r"\b(wait|let me (re-?)?check|let me verify|double[- ]check|let me re-?calculate|"
    r"on second thought|hmm)\b",
    re.IGNORECASE,
)


def reflection_rate(completions: Sequence[str]) -> float:
    """Share of completions with at least one self-check phrase ("wait", "let me check", ...)."""
    if not completions:
        return 0.0
    return sum(bool(REFLECTION_RE.search(c)) for c in completions) / len(completions)


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends to metrics.jsonl (a resumed run's rows past its step are dropped by grpo.runs.directory)."""

    def __init__(self, run_dir: Path, keep_through_step: int) -> None:
        self.file = (run_dir / "metrics.jsonl").open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorboardSink:
    def __init__(self, run_dir: Path, keep_through_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=keep_through_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases in offline mode (sync later with `wandb sync`) unless WANDB_MODE says
    otherwise; files under <run_dir>/wandb. Resuming a run continues the same wandb run."""

    def __init__(self, run_dir: Path, keep_through_step: int) -> None:
        import wandb

        self.run = wandb.init(
            dir=str(run_dir),
            name=run_dir.name,
            id=wandb_run_id(run_dir),
            resume="allow",
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_run_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run appends to the same wandb run."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


class TrackioSink:
    """Trackio, local only (a SQLite database, no Space is created), project "grpo", one trackio
    run per run directory. The database is under TRACKIO_DIR, which trackio reads once, when it
    is first imported: <run_dir>/trackio unless set before, or trackio was imported earlier in
    the process. The folder used is printed."""

    def __init__(self, run_dir: Path, keep_through_step: int) -> None:
        os.environ.setdefault("TRACKIO_DIR", str(run_dir / "trackio"))
        import trackio

        self.trackio = trackio
        trackio.init(project="grpo", name=run_dir.name, resume="allow")
        utils = getattr(trackio, "utils", None)  # trackio's own record of the folder it uses
        print(f"metrics sink 'trackio': {getattr(utils, 'TRACKIO_DIR', os.environ['TRACKIO_DIR'])}")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


SINKS: dict[str, type] = {
    "jsonl": JsonlSink,
    "tensorboard": TensorboardSink,
    "wandb": WandbSink,
    "trackio": TrackioSink,
}
OPTIONAL_SINKS = {"wandb", "trackio"}


class MetricsLogger:
    """Fans each step's metrics out to the configured sinks.

    An optional sink (wandb, trackio) that cannot start, or fails while logging, costs one line
    on the console and is dropped; the run and the other sinks go on. jsonl and tensorboard
    failures stop the run (the run directory itself is broken then).
    """

    def __init__(self, run_dir: Path, sinks: list[str], keep_through_step: int = 0) -> None:
        self.sinks: dict[str, Sink] = {}
        for name in dict.fromkeys(["jsonl", *sinks]):
            if name not in SINKS:
                raise ValueError(f"train.sinks: unknown sink '{name}' (use {', '.join(SINKS)})")
            try:
                self.sinks[name] = SINKS[name](run_dir, keep_through_step)
            except ImportError:
                if name not in OPTIONAL_SINKS:
                    raise
                print(f"metrics sink '{name}' skipped: package not installed")
            except Exception as err:  # a third-party sink may fail in any way: never the run
                if name not in OPTIONAL_SINKS:
                    raise
                print(
                    f"metrics sink '{name}' failed to start, run goes on without it: {_line(err)}"
                )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, metrics)
            except Exception as err:  # as above: an optional sink's failure must not end the run
                if name not in OPTIONAL_SINKS:
                    raise
                print(f"metrics sink '{name}' failed at step {step}, dropped: {_line(err)}")
                del self.sinks[name]

    def close(self) -> None:
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as err:  # the run's own files are complete; say so and go on
                if name not in OPTIONAL_SINKS:
                    raise
                print(f"metrics sink '{name}' failed to close: {_line(err)}")


def _line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


class ProgressBar:
    """Step, reward, KL and ETA on one line; silent when disabled."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.progress = None
        if enabled:
            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self.progress is None:
            return
        info = f"reward {metrics['reward/mean']:.3f}  kl {metrics.get('kl', 0.0):.4f}"
        self.progress.update(self.task, completed=step, info=info)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
