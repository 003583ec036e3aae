"""Run untrusted Python in a child process that cannot harm the trainer.

Each run gets a throw-away working directory, a scrubbed environment, a new session (process
group), and a bootstrap (``_sandbox_boot.py``) that applies, before the untrusted code starts:
a fresh network namespace (or, where the kernel refuses, Landlock TCP rules, or as a last resort
sockets disabled in the interpreter), CPU-time / address-space / file-size / process-count limits,
a per-run unprivileged uid when the trainer runs as root, and Landlock write and signal scoping.

The parent enforces a wall-clock deadline and caps the captured output. When the main process
exits or the deadline passes, every process of the run is killed: the process group, and, because a
program can leave its group with ``setsid``, every process of the run's uid (root) or session.
A fork bomb therefore meets RLIMIT_NPROC (bound to the run's own uid) and then this sweep.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

BOOTSTRAP = Path(__file__).with_name("_sandbox_boot.py")
STATUS_PREFIX = b"grpo-sandbox: "
# per-run uids (root only): far above the ids of real accounts, 64 slots per trainer process
UID_BASE = 1_000_000
SLOTS_PER_PROCESS = 64
SCRUBBED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
}


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    max_procs: int = 32
    max_output_bytes: int = 1 << 20


@dataclass
class SandboxResult:
    """What a run left behind.

    ``exit_code`` is None when the run was stopped (timeout); ``error`` says why a run did not end
    on its own (None when it did); ``isolation`` lists the restrictions the bootstrap applied.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    error: str | None = None
    isolation: list[str] = field(default_factory=list)


class _UidSlots:
    """Hands out distinct uids to concurrent runs of this process.

    Least recently used first: zombies of a killed run still count against its uid's RLIMIT_NPROC
    until init reaps them, so a uid is not handed out again right away.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free = deque(range(SLOTS_PER_PROCESS))

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(f"more than {SLOTS_PER_PROCESS} concurrent sandbox runs")
            slot = self._free.popleft()
        return UID_BASE + (os.getpid() % 100_000) * SLOTS_PER_PROCESS + slot

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append((uid - UID_BASE) % SLOTS_PER_PROCESS)


_SLOTS = _UidSlots()


def _closed_ancestor(path: Path) -> Path | None:
    """The outermost folder on ``path`` that other users cannot enter (no o+x), if any."""
    for parent in [*reversed(path.parents), path]:
        if parent.is_dir() and not parent.stat().st_mode & 0o001:
            return parent
    return None


def hidden_interpreter_folders() -> list[list[str]]:
    """[closed folder, interpreter folder inside it] pairs the per-run uid must still read.

    A pyenv or uv Python under /root (mode 700) is invisible to any other uid; the bootstrap
    binds just these folders back into an otherwise empty tmpfs over the closed folder.
    """
    roots = {Path(p).resolve() for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    roots |= {Path(p).resolve() for p in sys.path if p and Path(p).is_dir()}
    pairs: dict[str, str] = {}
    for root in sorted(roots, key=lambda p: len(p.parts)):
        closed = _closed_ancestor(root)
        if closed is not None and not any(root.is_relative_to(kept) for kept in map(Path, pairs)):
            pairs[str(root)] = str(closed)
    return [[closed, inner] for inner, closed in pairs.items()]


def _stat_fields(pid: str) -> tuple[str, int, int] | None:
    """(state, pgrp, session) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[3])


def _real_uid(pid: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def run_processes(session: int, uid: int | None) -> list[int]:
    """Live (non-zombie) processes of a run: its session or process group, or its own uid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        stat = _stat_fields(entry)
        if stat is None or stat[0] == "Z":
            continue
        if session in (stat[1], stat[2]) or (uid is not None and _real_uid(entry) == uid):
            found.append(int(entry))
    return found


def kill_run(session: int, uid: int | None, attempts: int = 200) -> None:
    """SIGKILL every process of a run until none is left (forks racing the sweep are caught)."""
    for _ in range(attempts):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, signal.SIGKILL)
        victims = run_processes(session, uid)
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    raise RuntimeError(f"sandbox: processes of session {session} survived {attempts} kill sweeps")


def _collect(proc: subprocess.Popen, limits: Limits, on_exit) -> tuple[bytes, bytes, bool]:
    """Read stdout/stderr (each capped) until both close or the wall-clock deadline passes.

    When the main process exits, ``on_exit`` kills what it left behind, which closes the pipes.
    """
    deadline = time.monotonic() + limits.wall_s
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    pidfd = os.pidfd_open(proc.pid)
    with selectors.DefaultSelector() as sel:
        for fd in buffers:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        try:
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return (
                        bytes(buffers[proc.stdout.fileno()]),
                        bytes(buffers[proc.stderr.fileno()]),
                        True,
                    )
                for key, _ in sel.select(remaining):
                    if key.fd == pidfd:
                        sel.unregister(pidfd)
                        on_exit()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    buf = buffers[key.fd]
                    buf += chunk[: max(0, limits.max_output_bytes - len(buf))]
        finally:
            os.close(pidfd)
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), False


def run_python(
    code: str,
    *,
    stdin: str = "",
    wall_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 1024,
    output_bytes: int = 1 << 20,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox and return what it printed.

    ``stdin`` is written to the program, then closed. The run is stopped after ``wall_s`` seconds
    (``timed_out``) or ``cpu_s`` CPU seconds; it may hold ``memory_mb``; each of stdout and
    stderr keeps its first ``output_bytes`` (the rest is read and dropped, so a flood never blocks
    the program or the caller). Every process the run started is gone when this returns.
    """
    limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, max_output_bytes=output_bytes)
    return run_limited(code, stdin, limits)


def run_limited(source: str, stdin: str, limits: Limits) -> SandboxResult:
    """``run_python`` with every limit of :class:`Limits`."""
    as_root = os.geteuid() == 0
    uid = _SLOTS.acquire() if as_root else os.getuid()
    gid = uid if as_root else os.getgid()
    workdir = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    proc: subprocess.Popen | None = None
    try:
        (workdir / "main.py").write_text(source)
        (workdir / "main.py").chmod(0o644)
        if as_root:
            os.chown(workdir, uid, gid)
        spec = {
            "workdir": str(workdir),
            "uid": uid,
            "gid": gid,
            "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb,
            "file_mb": limits.file_mb,
            "max_procs": limits.max_procs,
            "expose": hidden_interpreter_folders() if as_root else [],
        }
        env = {**SCRUBBED_ENV, "HOME": str(workdir), "TMPDIR": str(workdir)}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", str(BOOTSTRAP), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        sweep = lambda: kill_run(proc.pid, uid if as_root else None)  # noqa: E731
        out, err, timed_out = _collect(proc, limits, sweep)
    finally:
        if proc is not None:
            kill_run(proc.pid, uid if as_root else None)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if as_root:
            _SLOTS.release(uid)
    isolation: list[str] = []
    if err.startswith(STATUS_PREFIX):
        status, _, err = err.partition(b"\n")
        isolation = status[len(STATUS_PREFIX) :].decode().split(",")
    return SandboxResult(
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        error=f"wall-clock limit of {limits.wall_s:g} s" if timed_out else None,
        isolation=isolation,
    )
