"""The fork server: the bootstrap (``_boot.py``) started once per trainer process, forking a
keeper per run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

BOOT = Path(__file__).with_name("_boot.py")
SCRUBBED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
}


class ForkServerLost(Exception):
    """The fork server took no run: it died (killed) or stopped answering since the last."""

    def __init__(self, server: subprocess.Popen) -> None:
        super().__init__()
        self.server = server  # the one that failed


class ForkServer:
    """The bootstrap started once per trainer process, forking a keeper per run (a fork costs a
    few milliseconds, an interpreter start with its imports about a hundred)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = -1
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def send(self, fds: dict[str, int]) -> subprocess.Popen:
        """Hand a run's descriptors to the server; returns the server that took them."""
        with self._lock:
            if self._owner != os.getpid() or self._proc.poll() is not None:
                self._start()
            # one datagram per run: the names, and the descriptors as SCM_RIGHTS
            try:
                socket.send_fds(self._sock, [json.dumps(list(fds)).encode()], list(fds.values()))
            except OSError:  # killed since, not reaped yet
                raise ForkServerLost(self._proc) from None
            return self._proc

    def replace(self, failed: subprocess.Popen) -> None:
        """A new server in place of ``failed`` (it died, or stopped answering), killed; nothing
        when another thread replaced it already."""
        with self._lock:
            if self._owner != os.getpid() or self._proc is not failed:
                return
            if failed.poll() is None:
                failed.kill()
                failed.wait()
            self._start()

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


FORK_SERVER = ForkServer()
