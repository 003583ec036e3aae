"""The run directory: the one module that reads and writes a run's files.

``<output_dir>/<run_name>/`` holds::

    .lock                  an OS lock held by the training process for its whole life
    config.yaml            the resolved config the run now trains with
    config_history.jsonl   one line per start or resume: the step, and every key that changed
    metrics.jsonl          one JSON object per step (plus {"event": "resume", ...} rows)
    completions/           step-NNNNNN.jsonl: sampled completions of a step
    checkpoints/step-N/    HF folder + trainer_state.pt (+ rng-rank<r>.pt) + manifest.json
    final/                 HF folder + manifest.json

What it guarantees:

- **One writer.** ``claim`` takes a POSIX record lock (``fcntl.lockf``) on ``.lock``; a second run
  stops at once, naming the holder's pid. The kernel drops the lock when the holder dies, however
  it dies. (A record lock rather than ``flock``: it belongs to the process, so a worker the trainer
  forked, such as a reward pool, cannot keep a dead run's directory locked.)
- **Verified checkpoints.** A checkpoint (and ``final/``) is written under a temporary name; every
  file is fsynced, then ``manifest.json`` (size and sha256 of each file, the step, the run's
  config) is written last, the folder fsynced and renamed, and the parent fsynced. It counts only
  when its manifest verifies: resume takes the newest one that does, and moves a damaged one aside
  (``step-N.damaged``) with one warning line naming it.
- **Logs that survive a kill.** A resumed run drops ``metrics.jsonl`` rows after its step and a
  partial last line (what a kill or a full disk leaves), with a warning, and the completions of
  later steps.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_RE = re.compile(r"^step-(\d+)$")
DAMAGED_RE = re.compile(r"^step-(\d+)\.damaged$")  # a checkpoint moved aside
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# outputs of a previous run that a fresh start (no checkpoint, or train.resume=never) replaces
RUN_OUTPUTS = (
    "metrics.jsonl",
    "completions",
    "checkpoints",
    "final",
    "tensorboard",
    "config_history.jsonl",
)


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message is one line for the user."""


def warn(message: str) -> None:
    print(f"grpo: warning: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- files


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to the disk (a folder: the names it holds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> dict[str, Any]:
    """{"size": bytes, "sha256": hex} of one file."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def rows_digest(rows: list[dict[str, Any]]) -> str:
    """A fingerprint of the rows a run trains on, in their order: a data file edited between a
    checkpoint and its resume changes it, whatever its path."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\n")
    return digest.hexdigest()[:16]


def model_digest(path: str) -> str | None:
    """A fingerprint of a local model folder (None for a hub id): its config.json, and each
    weights file's name, size and first MiB (past the header, tensors' bytes), so another model
    put under the same name changes it without reading gigabytes."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    for file in [folder / "config.json", *weights]:
        if file.is_file():
            with file.open("rb") as f:
                digest.update(f"{file.name} {file.stat().st_size}\n".encode() + f.read(1 << 20))
    return digest.hexdigest()[:16]


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a reader sees the old file or the new one, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def seal(folder: Path, meta: dict[str, Any]) -> None:
    """fsync every file in ``folder``, then write its manifest (meta + each file's digest) last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        fsync_path(path)
        files[path.relative_to(folder).as_posix()] = file_digest(path)
    for sub in sorted(p for p in folder.rglob("*") if p.is_dir()):
        fsync_path(sub)
    with (folder / MANIFEST).open("w") as f:
        json.dump({**meta, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(folder)


def read_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST).read_text())


def _manifest_files(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's file list when it has the shape ``seal`` writes (a step, and each file's
    size and checksum); None for anything else, valid JSON or not."""
    try:
        manifest = read_manifest(folder)
        files = manifest["files"]
        well_formed = isinstance(manifest["step"], int) and all(
            isinstance(e["size"], int) and isinstance(e["sha256"], str) for e in files.values()
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return files if well_formed else None


def verify(folder: Path) -> str | None:
    """None when every file the manifest lists has its size and checksum; else what is wrong."""
    if not (folder / MANIFEST).is_file():
        return "it has no manifest.json (its write never finished)"
    files = _manifest_files(folder)
    if files is None:
        return "its manifest.json is unreadable"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, its manifest says {expected['size']}"
        if file_digest(path)["sha256"] != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


def replace_folder(tmp: Path, target: Path) -> None:
    """Rename a sealed ``tmp`` to ``target``; an existing ``target`` stays until the new one is in."""
    old = target.with_name(f".old-{target.name}")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    fsync_path(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def is_disk_full(err: BaseException) -> bool:
    """An error (or its cause) from a full disk or an exhausted quota, whichever library raised it."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        # torch's and safetensors' writers wrap the OS error in their own exception's text
        if "No space left on device" in str(seen) or "os error 28" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(rows, numbers of the lines that are not JSON objects). A file that is missing is empty."""
    if not path.exists():
        return [], []
    rows, bad = [], []
    # bytes: a line that is not UTF-8 is one more unreadable line (json.loads decodes each)
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number)
    return rows, bad


# --------------------------------------------------------------------------------------- config


# --------------------------------------------------------------------------------------- run dir


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its folder, step, the run config it was trained with, and the
    number of processes that wrote it."""

    path: Path
    step: int
    config: dict[str, Any]
    world_size: int
    inputs: dict[str, Any]  # fingerprints of the data and model (``INPUTS``); {} when older

    @classmethod
    def read(cls, folder: Path) -> Checkpoint | str:
        """The checkpoint in ``folder``, or what is wrong with it."""
        problem = verify(folder)
        if problem is not None:
            return problem
        manifest = read_manifest(folder)
        config, world = manifest.get("run_config"), manifest.get("world_size")
        if not isinstance(config, dict) or not isinstance(world, int):
            return "its manifest.json is unreadable"
        if "trainer_state.pt" not in manifest["files"]:
            return "it is a saved model, not a checkpoint (no trainer_state.pt)"
        inputs = manifest.get("inputs")
        return cls(
            folder, manifest["step"], config, world, inputs if isinstance(inputs, dict) else {}
        )


class RunDir:
    """Everything on disk for one run. Every rank has one for its paths (ranks > 0 write only
    their RNG state into a checkpoint's temp folder); only rank 0 claims the folder and writes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.final = path / "final"
        self.metrics = path / "metrics.jsonl"
        self.completions = path / "completions"
        self.history = path / "config_history.jsonl"
        self.intact: Path | None = None  # newest checkpoint known complete (for error messages)
        self._lock_fd: int | None = None

    # ----------------------------------------------------------------------------- lock

    def claim(self) -> None:
        """Check the folder is writable, lock it for this process's life, clear stale temp folders."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise RunDirError(
                f"train.output_dir: cannot write to {self.path} ({err.strerror})"
            ) from None
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise RunDirError(f"cannot lock {self.path / '.lock'} ({err.strerror})") from None
            holder = (self.path / ".lock").read_text().strip() or "another process"
            raise RunDirError(
                f"run directory {self.path} is in use by {holder}; wait for it to finish, "
                "or set another train.run_name"
            ) from None
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} (started {started})\n".encode(), 0)
        self._lock_fd = fd
        # what a dead writer left: folders being written, and old ones being replaced
        for pattern in (".tmp-*", ".old-*"):
            for stale in [*self.checkpoints.glob(pattern), *self.path.glob(pattern)]:
                shutil.rmtree(stale, ignore_errors=True)

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the lock
            self._lock_fd = None

    # ----------------------------------------------------------------------------- resume

    def step_folders(self) -> list[tuple[int, Path]]:
        if not self.checkpoints.is_dir():
            return []
        found = [(int(m[1]), p) for p in self.checkpoints.iterdir() if (m := STEP_RE.match(p.name))]
        return sorted(found, reverse=True)

    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest checkpoint whose manifest verifies; damaged newer ones are moved aside.

        None when there is none at all; an error when some exist but none verifies (starting over
        would silently drop them: the user decides with train.resume=never).
        """
        damaged = []
        for _, folder in self.step_folders():
            found = Checkpoint.read(folder)
            if isinstance(found, Checkpoint):
                self.intact = folder
                return found
            problem = found
            aside = folder.with_name(f"{folder.name}.damaged")
            shutil.rmtree(aside, ignore_errors=True)
            folder.rename(aside)
            warn(f"checkpoint {folder} is damaged ({problem}): moved to {aside.name}, skipped")
            damaged.append(folder.name)
        if damaged:
            raise RunDirError(
                f"no complete checkpoint in {self.checkpoints} ({', '.join(damaged)} damaged); "
                "set train.resume=never to start over"
            )
        return None

    @staticmethod
    def checkpoint_at(folder: Path) -> Checkpoint:
        """An explicit checkpoint folder (train.resume=<path>), which must verify."""
        found = Checkpoint.read(folder) if folder.is_dir() else "no such folder"
        if isinstance(found, str):
            raise RunDirError(f"train.resume: {folder} is not a complete checkpoint: {found}")
        return found

    def previous_run(self) -> list[str]:
        """What a previous run left here that a fresh start would delete and that cannot be
        written again from a checkpoint: its checkpoints (damaged ones included), its final
        model, the metrics of its steps. Empty for a new folder, or a run that died before its
        first step."""
        left = [p.name for p in sorted(self.checkpoints.glob("step-*")) if p.is_dir()]
        if self.final.exists():
            left.append("final/")
        rows, _ = read_jsonl(self.metrics)
        if any("event" not in row and row.get("step", 0) > 0 for row in rows):  # step 0: baseline
            left.append("metrics.jsonl")
        return left

    def rewind(self, step: int) -> list[str]:
        """Remove what a run went on to write after ``step``, which a resume from ``step``
        writes again: a newer final/ model and newer checkpoints (a later resume would pick
        them), by name. Before the logs are cut (``prepare_logs``), and each folder renamed to
        ``.old-*`` first (what ``claim`` clears), the newest last: a kill midway leaves the
        newest abandoned checkpoint whole with its logs, or the rewind's step as the newest."""
        doomed = []
        if self.final.exists():
            final = self.final_step()  # None when damaged: rewritten at the end either way
            if final is None or final > step:
                doomed.append(self.final)
        doomed += [folder for later, folder in reversed(self.step_folders()) if later > step]
        for folder in doomed:
            old = folder.with_name(f".old-{folder.name}")
            folder.rename(old)
            shutil.rmtree(old)
        return [f"{f.name}/" if f == self.final else f.name for f in doomed]

    def start_fresh(self) -> None:
        """A fresh start replaces a previous run's outputs instead of mixing with them."""
        for name in RUN_OUTPUTS:
            target = self.path / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)

    # ----------------------------------------------------------------------------- config

    def record_config(
        self, text: str, step: int, event: str, changes: dict[str, tuple[Any, Any]]
    ) -> None:
        """Write config.yaml and add a line to the config history (what changed, at which step)."""
        write_atomic(self.path / "config.yaml", text)
        entry = {
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "step": step,
            "event": event,
            "changed": {key: [old, new] for key, (old, new) in changes.items()},
        }
        with self.history.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    # ----------------------------------------------------------------------------- logs

    def prepare_logs(self, step: int) -> None:
        """Keep the logs of steps up to ``step``: the state the run continues from."""
        rows, bad = read_jsonl(self.metrics)
        if bad:
            lines = ", ".join(map(str, bad))
            warn(f"{self.metrics}: dropped unreadable line(s) {lines} (a write cut short)")
        kept = [row for row in rows if row.get("step", 0) <= step]
        if bad or len(kept) != len(rows):
            write_atomic(self.metrics, "".join(json.dumps(row) + "\n" for row in kept))
        for stale in self.completions.glob("step-*.jsonl"):
            if int(stale.stem.split("-")[1]) > step:
                stale.unlink()

    def log_event(self, step: int, event: str, **fields: Any) -> None:
        """A row in metrics.jsonl that is not a step's metrics (e.g. where a resume continued)."""
        with self.metrics.open("a") as f:
            f.write(json.dumps({"step": step, "event": event, **fields}) + "\n")

    def write_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        self.completions.mkdir(exist_ok=True)
        text = "".join(json.dumps(record) + "\n" for record in records)
        tmp = self.completions / f".step-{step:06d}.jsonl.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.completions / f"step-{step:06d}.jsonl")

    # ----------------------------------------------------------------------------- checkpoints

    def checkpoint_temp(self, step: int) -> Path:
        """Where checkpoint ``step`` is written before ``commit_checkpoint`` (every rank writes here)."""
        return self.checkpoints / f".tmp-step-{step}"

    def final_temp(self) -> Path:
        return self.path / ".tmp-final"

    @staticmethod
    def fresh_temp(tmp: Path) -> None:
        """An empty temp folder (what a dead writer left there is dropped)."""
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def commit_checkpoint(self, step: int, meta: dict[str, Any], keep_last: int) -> Path:
        """Seal the temp folder of ``step``, rename it into place, prune to ``keep_last``."""
        tmp = self.checkpoint_temp(step)
        target = self.checkpoints / f"step-{step}"
        seal(tmp, {"step": step, **meta})
        replace_folder(tmp, target)
        self.intact = target
        for _, old in self.step_folders()[keep_last:]:
            shutil.rmtree(old)
        # a damaged checkpoint goes once it is older than every one kept, as it would have
        oldest = self.step_folders()[-1][0]
        for damaged in self.checkpoints.iterdir():
            if (m := DAMAGED_RE.match(damaged.name)) and int(m[1]) < oldest:
                shutil.rmtree(damaged)
        return target

    def commit_final(self, step: int, meta: dict[str, Any]) -> Path:
        seal(self.final_temp(), {"step": step, **meta})
        replace_folder(self.final_temp(), self.final)
        return self.final

    def final_step(self) -> int | None:
        """The step of a complete final/ (None when missing or damaged)."""
        if verify(self.final) is not None:
            return None
        return read_manifest(self.final)["step"]

    @staticmethod
    @contextlib.contextmanager
    def cleanup_on_error(tmp: Path) -> Iterator[None]:
        """Remove a half-written temp folder when writing fails (on a full disk it frees space)."""
        try:
            yield
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def nearly_full(self) -> bool:
        """Under 1 MiB free: whatever a library's error says, the disk is the likely cause."""
        try:
            return shutil.disk_usage(self.path).free < 1 << 20
        except OSError:
            return False

    def disk_full_message(self, err: BaseException) -> str:
        where = getattr(err, "filename", None) or self.path
        intact = f"{self.intact} is intact" if self.intact else "no checkpoint was written yet"
        return (
            f"disk full while writing {where}: {intact}; free space and run the same command "
            "to resume"
        )


def complete_final(run: Path) -> Path:
    """``run``/final when it is complete; else a one-line error saying what there is instead."""
    folder = RunDir(run)
    if folder.final_step() is not None:
        return folder.final
    steps = [p for _, p in folder.step_folders() if verify(p) is None]
    hint = f"; its newest complete checkpoint is {steps[0]}" if steps else ""
    state = "is damaged" if folder.final.exists() else "is missing (the run has not finished)"
    raise RunDirError(f"{folder.final} {state}{hint}")
