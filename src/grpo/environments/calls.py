"""Calls into environment code, run concurrently and each bounded in time.

An environment's code (a user's class, a client of a server) may be slow, may raise and may
never return. ``run_calls`` runs a round's calls on at most ``threads`` threads at once, each
within ``timeout_s`` of its own start; a call still running then is abandoned (a daemon thread:
Python cannot stop a thread, but an abandoned one neither holds back the round nor keeps the
process alive at exit) and reported as timed out. Every outcome is an ``Outcome``: a value, or
one line saying what went wrong; but an ``EnvironmentFailure`` (an environment that cannot go
on) is raised once the round's calls are over.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.environments import EnvironmentFailure
from grpo.runtime.user_code import error_line


@dataclass(frozen=True)
class Outcome:
    """A call's value, or its ``error`` (one line: the exception, or the timeout), and its
    seconds (the limit, for a call that timed out)."""

    value: Any
    error: str | None
    time_s: float


def run_calls(
    calls: list[Callable[[], Any]], threads: int, timeout_s: float | None
) -> list[Outcome]:
    """The calls' outcomes, in order: at most ``threads`` running at once (abandoned ones not
    counted), each given ``timeout_s`` seconds from its start (None: no limit)."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    finished = threading.Condition()

    lost: list[EnvironmentFailure] = []  # the run cannot go on: raised once the round is over

    def run(i: int, t0: float) -> None:
        try:
            value, error = calls[i](), None
        except EnvironmentFailure as err:
            lost.append(err)
            value, error = None, str(err)
        except BaseException as err:  # environment code: any failure is reported, never
            # raised; SystemExit and KeyboardInterrupt too (raised here they end only this thread)
            value, error = None, error_line(err)
        with finished:
            if outcomes[i] is None:  # not already given up on
                outcomes[i] = Outcome(value, error, time.perf_counter() - t0)
            finished.notify_all()

    waiting = list(range(len(calls)))[::-1]
    running: dict[int, float] = {}  # call -> its deadline
    with finished:
        while waiting or running:
            while waiting and len(running) < threads:
                i, t0 = waiting.pop(), time.perf_counter()
                running[i] = t0 + timeout_s if timeout_s is not None else math.inf
                threading.Thread(target=run, args=(i, t0), daemon=True).start()
            now = time.perf_counter()
            for i, deadline in list(running.items()):
                if outcomes[i] is None and now >= deadline:
                    outcomes[i] = Outcome(None, f"timed out after {timeout_s:g} s", timeout_s)
                if outcomes[i] is not None:
                    del running[i]
            if running and (len(running) >= threads or not waiting):
                earliest = min(running.values()) - now
                finished.wait(earliest if earliest < math.inf else None)
    if lost:
        raise lost[0]
    return [o for o in outcomes if o is not None]
