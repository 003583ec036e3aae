"""Run untrusted Python where it cannot reach the trainer, and judge it from another process.

Two entry points:

- :func:`run_python` runs a program (``main.py``) with stdin and returns what it printed: the
  sandboxed Python tool of multi-turn rollouts and the stdin/stdout tests of the code reward.
- :func:`judge_calls` runs a program as a *candidate* and the row's test code in a separate
  *judge* process; the judge calls the candidate's functions through proxies that exchange plain
  serialized values (``_wire.py``), and reports each test's verdict on a pipe that only it
  holds. Nothing the candidate prints, writes or leaves behind can change the verdict.

Every sandboxed process starts in ``_boot.py`` (its docstring lists each layer): fresh PID,
mount, network, IPC and UTS namespaces (through a user namespace when the trainer is not root),
a private size-capped ``/tmp`` as its working directory, the trainer's home, working directory and
temp folders masked, rlimits, a per-run uid as root (no capabilities otherwise), and Landlock.
Memory is capped by a cgroup per process where the machine lets the trainer create one (cgroup v2
with the memory controller, else v1's memory and pids hierarchies); otherwise by RLIMIT_AS plus
size caps on every file system the run can write (tmpfs sizes, RLIMIT_FSIZE per file including
memfds, RLIMIT_NOFILE). When a run returns, every process it started is gone: the trainer kills
the first process of its PID namespace (the kernel then kills the rest) and waits until the
keeper outside the namespace has reaped it. A fork server, started once per trainer process,
forks each run's keeper.
docs/rewards.md, "Code sandbox (code)", states the threat model.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

BOOT = Path(__file__).with_name("_boot.py")
# per-run uids (root only): far above the ids of real accounts, 64 slots per trainer process
UID_BASE = 1_000_000
SLOTS_PER_PROCESS = 64
SCRUBBED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
}
# folders a run never sees, besides the trainer's home and working directory
TEMP_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")
SYSTEM_FOLDERS = ("/usr", "/etc", "/bin", "/lib", "/lib64", "/sbin", "/proc", "/sys", "/dev")
MAX_FILES = 64
VERDICT_BYTES = 1 << 20
# setting a run up takes milliseconds; on a machine under heavy load it may take seconds, which
# do not count against the program's wall-clock limit
STARTUP_TIMEOUT_S = 60.0


class SandboxUnavailable(RuntimeError):
    """The machine offers neither root nor unprivileged user namespaces: no sandbox."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed process (a judged program gets them twice: candidate
    and judge each)."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    max_procs: int = 32
    output_bytes: int = 1 << 20


@dataclass
class SandboxResult:
    """What a run left behind.

    ``exit_code`` is None when the run was stopped at the wall-clock limit (``timed_out``), and
    negative (``-signal``) when a signal ended it; ``error`` says why a run did not end on its own
    terms (None when it did); stdout and stderr keep their first ``output_bytes`` each.
    ``isolation`` lists the layers the bootstrap applied. ``pid`` is the run's first process (PID
    1 of its namespace ``pidns``, ``pid:[inode]``; every other process of the run died with it)
    and ``uid`` its per-run uid (root only): what leak checks look for.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    error: str | None = None
    isolation: list[str] = field(default_factory=list)
    pidns: str = ""
    pid: int | None = None
    uid: int | None = None


@dataclass
class Verdict:
    """A judged program: the indices of the tests that passed (reported by the judge alone),
    the candidate's run, and whether the judge finished before the wall-clock limit."""

    passed: list[int]
    candidate: SandboxResult
    judge_stderr: str
    finished: bool


class _UidSlots:
    """Hands out distinct uids to concurrent runs of this process.

    Least recently used first: a uid is not handed out again right away.
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
_COUNTER = itertools.count()


# ---------------------------------------------------------------------------- what a run sees


def _closed_ancestor(path: Path) -> Path | None:
    """The outermost folder on ``path`` that other users cannot enter (no o+x), if any."""
    for parent in [*reversed(path.parents), path]:
        if parent.is_dir() and not parent.stat().st_mode & 0o001:
            return parent
    return None


def interpreter_folders() -> list[Path]:
    """Folders the run's Python must read: its prefixes and the boot code's folder. The trainer's
    other import paths (a project folder, pytest's test folder) may hold data or tests, so they
    stay hidden: the sandboxed interpreter runs isolated (-I) and imports nothing from them."""
    roots = {Path(p).resolve() for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    roots.add(BOOT.parent.resolve())
    return sorted(roots)


def mount_plan(as_root: bool) -> dict[str, list[str]]:
    """Folders to mask with an empty tmpfs, and interpreter folders to bind back inside them.

    Masked: the temp folders, the trainer's home and working directory, and as root the closed
    folders holding the interpreter (a pyenv under /root, mode 700, is invisible to a per-run uid).
    Never masked: a folder holding system files or one inside an interpreter folder.
    """
    roots = interpreter_folders()
    wanted = [Path(p) for p in TEMP_FOLDERS] + [Path.home(), Path.cwd()]
    if as_root:
        wanted += [c for c in map(_closed_ancestor, roots) if c is not None]
    masks: list[Path] = []
    for folder in sorted({p.resolve() for p in wanted if p.is_dir()}, key=lambda p: len(p.parts)):
        system = any(Path(s).is_relative_to(folder) for s in SYSTEM_FOLDERS)
        inside_root = any(folder.is_relative_to(r) for r in roots)
        nested = any(folder.is_relative_to(m) for m in masks)
        if folder != Path("/") and not system and not inside_root and not nested:
            masks.append(folder)
    return {"masks": [str(m) for m in masks], "roots": [str(r) for r in roots]}


@functools.lru_cache(maxsize=8)
def _cached_plan(as_root: bool, *where: object) -> dict[str, list[str]]:
    """``mount_plan`` once per import path, working directory and home (it stats many folders)."""
    return mount_plan(as_root)


# ---------------------------------------------------------------------------- cgroups


@functools.cache
def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """Hierarchy ('unified', 'memory', 'pids') -> (mount point, mount root)."""
    found: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fstype, _, options = after.split()[:3]
        root, point = before.split()[3:5]
        if fstype == "cgroup2":
            found["unified"] = (point, root)
        elif fstype == "cgroup":
            for controller in ("memory", "pids"):
                if controller in options.split(","):
                    found[controller] = (point, root)
    return found


def _own_cgroup(hierarchy: str) -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if (hierarchy == "unified" and controllers == "") or hierarchy in names:
            return path
    return None


def _new_cgroup(hierarchy: str) -> Path | None:
    mount = _cgroup_mounts().get(hierarchy)
    own = _own_cgroup(hierarchy)
    if mount is None or own is None:
        return None
    point, root = mount
    relative = os.path.relpath(own, root) if own != root else ""
    folder = Path(point, relative, f"grpo-sandbox-{os.getpid()}-{next(_COUNTER)}")
    try:
        folder.mkdir()
    except OSError:
        return None
    return folder


@dataclass
class _Cgroup:
    """One run's cgroup folders (v2: one; v1: memory and pids) and how to limit and empty them."""

    folders: list[Path]
    oom_file: str

    def kill(self) -> None:
        for folder in self.folders:
            if (folder / "cgroup.kill").exists():
                (folder / "cgroup.kill").write_text("1")
            for _ in range(100):  # forks racing the sweep are caught by the next round
                pids = (folder / "cgroup.procs").read_text().split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    def oom_killed(self) -> bool:
        text = (self.folders[0] / self.oom_file).read_text()
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        for folder in self.folders:
            for _ in range(100):  # the last tasks leave the cgroup just after they die
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def make_cgroup(limits: Limits) -> _Cgroup | None:
    """A cgroup capping the memory (all of it: heap, tmpfs, memfds, page tables) and tasks of
    one process tree, or None where the trainer cannot create one."""
    made: list[Path] = []
    try:
        unified = _new_cgroup("unified")
        if unified is not None:
            made.append(unified)
            if (unified / "memory.max").exists():
                _write_limits(unified, limits, "memory.max", "memory.swap.max", "pids.max")
                return _Cgroup(made, "memory.events")
            made.pop().rmdir()
        memory = _new_cgroup("memory")
        if memory is None:
            return None
        made.append(memory)
        _write_limits(memory, limits, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        pids = _new_cgroup("pids")
        if pids is not None:
            made.append(pids)
            _write_limits(pids, limits, "pids.max")
        return _Cgroup(made, "memory.oom_control")
    except OSError:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        return None


def _write_limits(folder: Path, limits: Limits, *names: str) -> None:
    """Write the limits a cgroup folder offers (swap: none beyond the memory limit)."""
    values = {
        "memory.max": limits.memory_mb << 20,
        "memory.swap.max": 0,
        "memory.limit_in_bytes": limits.memory_mb << 20,
        "memory.memsw.limit_in_bytes": limits.memory_mb << 20,
        "pids.max": limits.max_procs,
    }
    for name in names:
        if (folder / name).exists():
            (folder / name).write_text(str(values[name]))


# ---------------------------------------------------------------------------- one process tree


class _ForkServer:
    """The bootstrap started once per trainer process, forking a keeper per run (a fork costs a
    few milliseconds, an interpreter start with its imports about a hundred)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = -1
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def send(self, fds: dict[str, int]) -> None:
        with self._lock:
            if self._owner != os.getpid() or self._proc.poll() is not None:
                self._start()
            # one datagram per run: the names, and the descriptors as SCM_RIGHTS
            socket.send_fds(self._sock, [json.dumps(list(fds)).encode()], list(fds.values()))

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-B", str(BOOT), str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            cwd="/",
            env=SCRUBBED_ENV,
            start_new_session=True,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._sock, self._owner = ours, os.getpid()


_SERVER = _ForkServer()


class _Ctl:
    """The trainer's end of a run's control socket: JSON lines from the keeper and PID 1."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def message(self) -> dict:
        """The next message, or {} at EOF."""
        while b"\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                return {}
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)


@dataclass
class _Process:
    """A started sandboxed process tree: its keeper, and PID 1 of its namespace."""

    ctl: _Ctl
    stdout: int
    stderr: int
    uid: int | None
    cgroup: _Cgroup | None
    keeper_fd: int | None = None
    first_fd: int | None = None
    first_pid: int | None = None
    isolation: list[str] = field(default_factory=list)
    pidns: str = ""
    exit_code: int | None = None

    def stop(self) -> None:
        """Kill every process of the run and wait until they are gone.

        PID 1 exits only after the kernel has killed the rest of its namespace; the keeper reaps
        it, reports its status and exits (the keeper itself is killed only if PID 1 never ran).
        """
        if self.first_fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.first_fd, signal.SIGKILL)
        elif self.keeper_fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.keeper_fd, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        for fd in (self.first_fd, self.keeper_fd):
            if fd is not None:
                select.select([fd], [], [])

    def finish(self) -> None:
        """The exit status the keeper reported (it may already have said it)."""
        self.ctl.sock.settimeout(None)
        while message := self.ctl.message():
            self.exit_code = message.get("exit", self.exit_code)

    def release(self) -> None:
        for fd in (self.keeper_fd, self.first_fd, self.stdout, self.stderr):
            if fd is not None:
                os.close(fd)
        self.ctl.sock.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.uid is not None:
            _SLOTS.release(self.uid)


def _start(role: str, source: str, stdin: str, limits: Limits, fds: dict[str, int]) -> _Process:
    as_root = os.geteuid() == 0
    uid = _SLOTS.acquire() if as_root else None
    cgroup = make_cgroup(limits)
    ours, theirs = socket.socketpair()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    spec = {
        "role": role,
        "source": source,
        "stdin": stdin,
        "env": SCRUBBED_ENV,
        "uid": uid,
        "gid": uid,
        "cpu_s": limits.cpu_s,
        "memory_mb": limits.memory_mb,
        "file_mb": limits.file_mb,
        "max_procs": limits.max_procs,
        "max_files": MAX_FILES,
        "cgroup_procs": [str(f / "cgroup.procs") for f in cgroup.folders] if cgroup else [],
        **_cached_plan(as_root, tuple(sys.path), os.getcwd(), os.path.expanduser("~")),
    }
    process = _Process(_Ctl(ours), out_r, err_r, uid, cgroup)
    try:
        try:
            _SERVER.send({"ctl": theirs.fileno(), "stdout": out_w, "stderr": err_w, **fds})
        finally:
            for fd in (theirs.fileno(), out_w, err_w):
                os.close(fd)
            theirs.detach()
        data = json.dumps(spec).encode()
        ours.settimeout(STARTUP_TIMEOUT_S)
        with contextlib.suppress(OSError):  # a keeper that failed says why below
            ours.sendall(len(data).to_bytes(8, "big") + data)
        started = process.ctl.message()
        if "pid" in started:
            process.keeper_fd = os.pidfd_open(started["keeper"])
            process.first_fd = os.pidfd_open(started["pid"])  # PID 1 waits for the go
            process.first_pid = started["pid"]
            with contextlib.suppress(OSError):
                process.pidns = os.readlink(f"/proc/{started['pid']}/ns/pid")
            ours.sendall(b"g")
            ready = process.ctl.message()
        else:
            ready = started
        if "isolation" not in ready:
            raise SandboxUnavailable(_why_unavailable(ready, process))
        process.isolation = ready["isolation"]
    except BaseException:
        process.stop()
        process.release()
        raise
    return process


def _why_unavailable(status: dict, process: _Process) -> str:
    process.stop()
    os.set_blocking(process.stderr, False)
    with contextlib.suppress(BlockingIOError):
        stderr = os.read(process.stderr, 65536).decode(errors="replace").strip().splitlines()
    reason = status.get("error") or (stderr[-1] if stderr else "the bootstrap exited")
    return (
        f"the code sandbox cannot start here ({reason}); it needs root or unprivileged user "
        "namespaces (sysctls user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 "
        "where it exists, and on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0)"
    )


def _pump(
    streams: dict[int, bytearray], caps: dict[int, int], stop_fd: int, deadline: float
) -> bool:
    """Read ``streams`` (keeping at most ``caps`` bytes each; the rest is read and dropped, so a
    flood never blocks its writer) until ``stop_fd`` is readable; True when the deadline passed."""
    with selectors.DefaultSelector() as sel:
        for fd in streams:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(stop_fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            for key, _ in sel.select(remaining):
                if key.fd == stop_fd:
                    return False
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = streams[key.fd]
                buf += chunk[: max(0, caps[key.fd] - len(buf))]


def _drain(streams: dict[int, bytearray], caps: dict[int, int]) -> None:
    """Read what is left once every writer is dead."""
    for fd, buf in streams.items():
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(fd, 65536):
                buf += chunk[: max(0, caps[fd] - len(buf))]


def _result(
    process: _Process, out: bytes, err: bytes, timed_out: bool, limits: Limits
) -> SandboxResult:
    code = None if timed_out else process.exit_code
    error = None
    if timed_out:
        error = f"wall-clock limit of {limits.wall_s:g} s"
    elif process.cgroup is not None and process.cgroup.oom_killed():
        error = f"memory limit of {limits.memory_mb} MiB"
    elif code is not None and code < 0:
        error = f"killed by {signal.Signals(-code).name}"
    return SandboxResult(
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        exit_code=code,
        timed_out=timed_out,
        error=error,
        isolation=process.isolation,
        pidns=process.pidns,
        pid=process.first_pid,
        uid=process.uid,
    )


def run_limited(source: str, stdin: str, limits: Limits) -> SandboxResult:
    """:func:`run_python` with every limit of :class:`Limits`."""
    process = _start("script", source, stdin, limits, {})
    deadline = time.monotonic() + limits.wall_s
    try:
        streams = {process.stdout: bytearray(), process.stderr: bytearray()}
        caps = dict.fromkeys(streams, limits.output_bytes)
        timed_out = _pump(streams, caps, process.ctl.sock.fileno(), deadline)
        process.stop()
        process.finish()
        _drain(streams, caps)
        out, err = bytes(streams[process.stdout]), bytes(streams[process.stderr])
        return _result(process, out, err, timed_out, limits)
    finally:
        process.stop()
        process.release()


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

    ``stdin`` is the program's standard input. The run is stopped after ``wall_s`` seconds
    (``timed_out``) or ``cpu_s`` CPU seconds; everything it holds (heap, files, shared memory)
    stays within ``memory_mb``; each of stdout and stderr keeps its first ``output_bytes``.
    The working directory is a private, empty ``/tmp``. Every process the run started is gone
    when this returns. Raises :class:`SandboxUnavailable` where no sandbox can be built.
    """
    limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, output_bytes=output_bytes)
    return run_limited(code, stdin, limits)


def judge_calls(
    program: str,
    tests: list[str],
    *,
    prefix: str | None = None,
    entry_point: str | None = None,
    limits: Limits = Limits(),
) -> Verdict:
    """Run ``program`` as a candidate and ``tests`` (Python snippets: asserts, or HumanEval's
    ``check`` script) in a separate judge process that calls the candidate's functions by name.

    ``prefix`` is trusted code run in the judge before the tests (HumanEval's prompt, whose
    helpers some checks use); ``entry_point`` always names the candidate's function there.
    """
    calls_r, calls_w = os.pipe()  # judge -> candidate
    replies_r, replies_w = os.pipe()  # candidate -> judge
    verdict_r, verdict_w = os.pipe()  # judge -> trainer
    started: list[_Process] = []
    try:
        started.append(
            _start("candidate", program, "", limits, {"calls_in": calls_r, "calls_out": replies_w})
        )
        task = json.dumps({"tests": tests, "prefix": prefix, "entry_point": entry_point})
        judge_fds = {"calls_in": replies_r, "calls_out": calls_w, "verdict": verdict_w}
        started.append(_start("judge", "", task, limits, judge_fds))
        for fd in (calls_r, calls_w, replies_r, replies_w, verdict_w):
            os.close(fd)
        calls_r = calls_w = replies_r = replies_w = verdict_w = -1
        deadline = time.monotonic() + limits.wall_s
        candidate, judge = started
        caps = {
            candidate.stdout: limits.output_bytes,
            candidate.stderr: limits.output_bytes,
            judge.stdout: 0,
            judge.stderr: limits.output_bytes,
            verdict_r: VERDICT_BYTES,
        }
        streams = {fd: bytearray() for fd in caps}
        timed_out = _pump(streams, caps, judge.ctl.sock.fileno(), deadline)
        for process in started:
            process.stop()
            process.finish()
        _drain(streams, caps)
        lines = bytes(streams[verdict_r]).decode(errors="replace").splitlines()
        passed = {int(line[5:]) for line in lines if line[:5] == "pass " and line[5:].isdigit()}
        out, err = bytes(streams[candidate.stdout]), bytes(streams[candidate.stderr])
        return Verdict(
            passed=sorted(i for i in passed if i < len(tests)),
            candidate=_result(candidate, out, err, timed_out, limits),
            judge_stderr=bytes(streams[judge.stderr]).decode(errors="replace"),
            finished="done" in lines,
        )
    finally:
        for fd in (calls_r, calls_w, replies_r, replies_w, verdict_w, verdict_r):
            if fd >= 0:
                os.close(fd)
        for process in started:
            process.stop()
            process.release()
