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


class ForkServer:
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

    def replace(self) -> None:
        """A new server, the old one killed (it died, or stopped answering)."""
        with self._lock:
            if self._owner == os.getpid() and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
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
