"""Stopping on SIGINT / SIGTERM: after the current step with a checkpoint, or at once on a second
Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any


class TrainingStopped(Exception):
    """The run stopped on SIGINT / SIGTERM; ``checkpoint`` is the newest complete one (or None)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, at_once: bool) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        how = "at once (second Ctrl-C) in step" if at_once else "after step"
        saved = f"{checkpoint} is complete" if checkpoint else "no checkpoint was written"
        super().__init__(f"stopped by {name} {how} {step}: {saved}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the current step (``signum`` is set);
    a second SIGINT stops at once. Installed only in the main thread (Python's rule)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: bool = True) -> None:
        self.signum = 0
        self.announce = announce  # under torchrun only rank 0 says so
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.signum and self.announce:
            name = signal.Signals(signum).name
            print(
                f"grpo: {name}: stopping after this step and writing a checkpoint "
                "(Ctrl-C again stops at once)",
                file=sys.stderr,
                flush=True,
            )
        self.signum = self.signum or signum
