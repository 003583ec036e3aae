"""One sandboxed process tree: started through the fork server with its limits, cgroup and
per-run uid, its output read under a deadline, and every process of it killed and reaped."""

from __future__ import annotations

import contextlib
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

from grpo.sandbox.cgroups import Cgroup, make_cgroup
from grpo.sandbox.fork_server import FORK_SERVER, SCRUBBED_ENV, ForkServerLost
from grpo.sandbox.limits import Limits, SandboxResult
from grpo.sandbox.mounts import cached_mount_plan

# per-run uids (root only): far above the ids of real accounts, 64 slots per trainer process
UID_BASE = 1_000_000
SLOTS_PER_PROCESS = 64
MAX_FILES = 64
# setting a run up takes milliseconds; on a machine under heavy load it may take seconds, which
# do not count against the program's wall-clock limit
STARTUP_TIMEOUT_S = 60.0
STARTUP_WAIT_S = 0.2  # how often a start that has no answer yet looks at the fork server


class SandboxUnavailable(RuntimeError):
    """The machine offers neither root nor unprivileged user namespaces: no sandbox."""


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
class Process:
    """A started sandboxed process tree: its keeper, and PID 1 of its namespace."""

    ctl: _Ctl
    stdout: int
    stderr: int
    uid: int | None
    cgroup: Cgroup | None
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


def start(role: str, source: str, stdin: str, limits: Limits, fds: dict[str, int]) -> Process:
    """A sandboxed process tree running ``role``; a fork server that was killed or stopped since
    the last run is replaced, and the run started again, once."""
    try:
        return _start(role, source, stdin, limits, fds, last_try=False)
    except ForkServerLost as lost:
        FORK_SERVER.replace(lost.server)
        return _start(role, source, stdin, limits, fds, last_try=True)


def _start(
    role: str, source: str, stdin: str, limits: Limits, fds: dict[str, int], last_try: bool
) -> Process:
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
        **cached_mount_plan(as_root, tuple(sys.path), os.getcwd(), os.path.expanduser("~")),
    }
    process = Process(_Ctl(ours), out_r, err_r, uid, cgroup)
    try:
        try:
            try:
                server = FORK_SERVER.send(
                    {"ctl": theirs.fileno(), "stdout": out_w, "stderr": err_w, **fds}
                )
            finally:
                for fd in (theirs.fileno(), out_w, err_w):
                    os.close(fd)
                theirs.detach()
            data = json.dumps(spec).encode()
            ours.settimeout(STARTUP_TIMEOUT_S)
            with contextlib.suppress(OSError):  # a keeper that failed says why below
                ours.sendall(len(data).to_bytes(8, "big") + data)
            await_keeper(ours, server)
            started = process.ctl.message()
        except ForkServerLost:  # dead before it took the run
            if not last_try:
                raise
            started = {"error": "the fork server died or stopped as it started"}
        except OSError as err:  # a reset, a broken pipe or STARTUP_TIMEOUT_S: no keeper
            if not last_try:
                raise ForkServerLost(server) from None
            started = {"error": f"the fork server took no run: {err}"}
        if not started and not last_try:  # closed without a word: the run died with it
            raise ForkServerLost(server)
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


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, or a tracer's stop): it answers nothing
    until continued."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def await_keeper(sock: socket.socket, server: subprocess.Popen) -> None:
    """Wait, up to ``STARTUP_TIMEOUT_S``, for the run's keeper to speak on ``sock``; a fork
    server that died or was stopped before forking it is lost at once (``ForkServerLost``), not
    after the limit, which is there for a machine under heavy load."""
    end = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        left = end - time.monotonic()
        if select.select([sock], [], [], max(0.0, min(STARTUP_WAIT_S, left)))[0]:
            return
        if server.poll() is not None or stopped(server.pid):
            raise ForkServerLost(server)
        if left <= 0:
            raise TimeoutError(f"no keeper within {STARTUP_TIMEOUT_S:g} s")


def _why_unavailable(status: dict, process: Process) -> str:
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


def pump(
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


def drain(streams: dict[int, bytearray], caps: dict[int, int]) -> None:
    """Read what is left once every writer is dead."""
    for fd, buf in streams.items():
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(fd, 65536):
                buf += chunk[: max(0, caps[fd] - len(buf))]


def result_of(
    process: Process, out: bytes, err: bytes, timed_out: bool, limits: Limits
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
