"""Worker processes for user reward functions, so a hanging or leaking function costs one timeout.

Each worker is a child process running ``_reward_worker.py`` (standard library only, started with
the trainer's ``sys.path``) that imports every user function once. A step's calls are queued onto
the workers; whatever still runs when the step's time limit passes is stopped by killing its
worker, and a worker whose resident memory passes the ceiling is killed too (during a call: that
call fails; after one: it is only replaced). Killed workers are replaced before their next call.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("_reward_worker.py")
POLL_S = 0.25  # how often a busy worker's memory is checked
PAGE = os.sysconf("SC_PAGE_SIZE")
# an answer is one value per completion: far below this, whatever the batch
MAX_ANSWER_BYTES = 64 << 20


class WorkerStartError(RuntimeError):
    """A worker could not import the functions; the message is one line for the user."""


@dataclass
class Outcome:
    """The result of one call. kind: ok | bad (malformed return) | raised | timeout | memory |
    died (the worker process ended or sent garbage).
    ``values`` for ok; otherwise ``detail`` says what happened (a traceback for raised).
    ``recycled``: the worker passed the memory ceiling after this call and was replaced."""

    kind: str
    values: list[float | None] | None = None
    detail: str = ""
    recycled: bool = False


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (0 where /proc is not available)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def read_message(conn: Connection, deadline: float) -> Any:
    """The next object on ``conn``, read by ``deadline`` (``time.monotonic``): a worker that
    writes part of a message and stalls cannot hold the step. The frame is ``Connection``'s (a
    4-byte big-endian length, or -1 and an 8-byte one, then the pickle). ``TimeoutError`` past
    the deadline, ``EOFError`` at the end of the pipe, anything else for bytes that are no
    message."""
    fd = conn.fileno()

    def take(n: int) -> bytes:
        got = bytearray()
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not wait([conn], left):
                raise TimeoutError
            chunk = os.read(fd, min(n - len(got), 1 << 20))
            if not chunk:
                raise EOFError
            got += chunk
        return bytes(got)

    (size,) = struct.unpack("!i", take(4))
    if size == -1:
        (size,) = struct.unpack("!Q", take(8))
    if not 0 <= size <= MAX_ANSWER_BYTES:  # a forged length would have us read gigabytes
        raise ValueError(f"a message of {size} bytes")
    return pickle.loads(take(size))


def _is_answer(message: Any, completions: int) -> bool:
    """A worker's answer to a call on ``completions`` completions, as
    ``_reward_worker.main`` sends them (its values went through ``check_values``)."""
    if not isinstance(message, tuple) or len(message) != 2:
        return False
    kind, payload = message
    if kind == "ok" and isinstance(payload, list) and len(payload) == completions:
        return all(value is None or type(value) is float for value in payload)
    return kind in ("bad", "raised") and isinstance(payload, str)


class _Worker:
    def __init__(self, refs: list[str], args: list[dict[str, Any] | None]) -> None:
        """Start the process; ``wait_ready`` then waits for its imports."""
        self.refs = refs
        to_worker, from_parent = os.pipe()
        from_worker, to_parent = os.pipe()
        argv = [str(WORKER), str(to_worker), str(to_parent), str(os.getpid())]
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-B", *argv],
            pass_fds=(to_worker, to_parent),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the trainer, which stops the workers
        )
        os.close(to_worker)
        os.close(to_parent)
        self.send = Connection(from_parent, readable=False)
        self.recv = Connection(from_worker, writable=False)
        self.send.send({"refs": refs, "args": args, "sys_path": list(sys.path)})

    def wait_ready(self, startup_s: float) -> None:
        """Return once the functions are imported; else stop and raise WorkerStartError."""
        try:
            if not self.recv.poll(startup_s):
                raise WorkerStartError(f"reward worker did not start within {startup_s:.0f} s")
            kind, detail = self.recv.recv()
        except EOFError:
            self.stop()
            raise WorkerStartError(
                f"reward worker exited while importing {', '.join(self.refs)} "
                f"(exit code {self.proc.returncode})"
            ) from None
        except WorkerStartError:
            self.stop()
            raise
        if kind != "ready":
            self.stop()
            raise WorkerStartError(detail)
        self.batched: list[bool] = detail  # each function's ``batched`` attribute

    def kill(self) -> None:
        """The worker and every process it started (its session's group: a reward's subprocess
        would outlive the worker otherwise; one that left the session with setsid escapes)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        self.kill()
        self.send.close()
        self.recv.close()


class WorkerPool:
    """``size`` worker processes for the user reward functions ``refs`` (module:fn or file.py:fn);
    where ``args[j]`` is a dict, ``refs[j]`` is a factory each worker calls with it (a built-in
    run in the workers)."""

    def __init__(
        self,
        refs: list[str],
        size: int,
        max_rss_mb: float,
        startup_s: float = 120.0,
        args: list[dict[str, Any] | None] | None = None,
    ) -> None:
        self.refs = refs
        self.args = args or [None] * len(refs)
        self.max_rss_mb = max_rss_mb
        self.startup_s = startup_s
        self.workers: list[_Worker | None] = [None] * size
        try:
            self._refill()
        except WorkerStartError:
            self.close()
            raise
        # which functions take the whole batch in one call (their ``batched`` attribute)
        self.batched = next(w.batched for w in self.workers if w is not None)

    def _refill(self) -> None:
        """Start a worker in every empty slot, all at once (imports overlap), and wait for them."""
        empty = [slot for slot, worker in enumerate(self.workers) if worker is None]
        for slot in empty:
            self.workers[slot] = _Worker(self.refs, self.args)
        failure = None
        for slot in empty:
            try:
                self.workers[slot].wait_ready(self.startup_s)
            except WorkerStartError as err:
                self.workers[slot] = None
                failure = err
        if failure is not None:
            raise failure

    def _worker(self, slot: int) -> _Worker:
        if self.workers[slot] is None:
            self._refill()
        return self.workers[slot]

    def _retire(self, slot: int) -> None:
        worker, self.workers[slot] = self.workers[slot], None
        if worker is not None:
            worker.stop()

    def run(
        self, calls: list[tuple[int, list[str], dict[str, Any]]], limit_s: float
    ) -> list[Outcome]:
        """Outcomes of ``(function index, completions, kwargs)`` calls, all ending within
        ``limit_s`` from now: calls still running then are stopped, calls not started fail."""
        deadline = time.monotonic() + limit_s
        queued = deque(range(len(calls)))
        outcomes: list[Outcome | None] = [None] * len(calls)
        busy: dict[int, int] = {}  # worker slot -> call index
        while queued or busy:
            for slot in range(len(self.workers)):
                while slot not in busy and queued and time.monotonic() < deadline:
                    j = queued.popleft()
                    failed = self._send(slot, calls[j])
                    if failed is None:
                        busy[slot] = j
                    else:
                        outcomes[j] = failed
            now = time.monotonic()
            if now >= deadline:
                break
            if not busy:
                continue
            by_conn = {self.workers[slot].recv: slot for slot in busy}
            for conn in wait(list(by_conn), timeout=min(deadline - now, POLL_S)):
                slot = by_conn[conn]
                j = busy.pop(slot)
                outcomes[j] = self._receive(slot, len(calls[j][1]), deadline, limit_s)
            for slot in list(busy):
                used = rss_mb(self.workers[slot].proc.pid)
                if used > self.max_rss_mb:
                    self._retire(slot)
                    outcomes[busy.pop(slot)] = Outcome(
                        "memory",
                        detail=f"its worker passed rewards.max_worker_rss_mb={self.max_rss_mb:g}"
                        f" during a call ({used:.0f} MiB); killed and replaced",
                    )
        for slot, j in busy.items():
            self._retire(slot)
            outcomes[j] = Outcome(
                "timeout",
                detail=f"a call still ran after rewards.timeout_s={limit_s:g} s; "
                "its worker was killed and replaced",
            )
        with contextlib.suppress(WorkerStartError):  # then the next call reports it
            self._refill()  # replaced now, so the next step starts with ready workers
        for j in queued:
            outcomes[j] = Outcome(
                "timeout",
                detail=f"calls not started within rewards.timeout_s={limit_s:g} s (every "
                "worker was busy: raise rewards.workers or rewards.timeout_s)",
            )
        return outcomes  # type: ignore[return-value]  # every index is filled above

    def _send(self, slot: int, call: tuple[int, list[str], dict[str, Any]]) -> Outcome | None:
        """Start a call on a worker (replacing a dead one); an Outcome when it cannot start."""
        try:
            self._worker(slot).send.send(call)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            return Outcome("bad", detail=f"its arguments cannot be sent to a worker: {err}")
        except OSError as err:  # the worker died between calls
            self._retire(slot)
            return Outcome("died", detail=f"its worker process died ({err}); replaced")
        except WorkerStartError as err:
            return Outcome("raised", detail=f"a replacement worker failed to start: {err}")
        return None

    def _receive(self, slot: int, completions: int, deadline: float, limit_s: float) -> Outcome:
        worker = self.workers[slot]
        try:
            message = read_message(worker.recv, deadline)
        except TimeoutError:
            self._retire(slot)
            return Outcome(
                "timeout",
                detail=f"its worker sent part of an answer and no more within rewards.timeout_s="
                f"{limit_s:g} s; killed and replaced",
            )
        except EOFError:
            worker.proc.wait()
            code = worker.proc.returncode
            self._retire(slot)
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return Outcome("died", detail=f"its worker process died ({how}); replaced")
        # unpickling garbage raises whatever the bytes lead it to (pickle names no closed set)
        except Exception:
            message = None
        if not _is_answer(message, completions):
            self._retire(slot)
            return Outcome(
                "died", detail="its worker process sent garbage, not an answer; killed and replaced"
            )
        kind, payload = message
        outcome = Outcome(kind, payload) if kind == "ok" else Outcome(kind, detail=payload)
        if rss_mb(worker.proc.pid) > self.max_rss_mb:
            self._retire(slot)
            outcome.recycled = True
        return outcome

    def close(self) -> None:
        """Stop every worker: idle ones exit on end of input, busy ones are killed."""
        for worker in self.workers:
            if worker is not None:
                worker.send.close()
        end = time.monotonic() + 1.0
        for slot, worker in enumerate(self.workers):
            if worker is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(max(end - time.monotonic(), 0.01))
                worker.kill()
                worker.recv.close()
                self.workers[slot] = None
