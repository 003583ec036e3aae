"""Calls into environment code: concurrent up to a bound, each cut at its timeout, a failure
one line, the order kept."""

from __future__ import annotations

import threading
import time

from grpo.environments.calls import error_line, run_calls


def test_calls_run_at_most_threads_at_once_and_keep_their_order() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def call(i: int):
        def run() -> int:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            time.sleep(0.2)
            with lock:
                running -= 1
            return i

        return run

    t0 = time.perf_counter()
    outcomes = run_calls([call(i) for i in range(8)], threads=4, timeout_s=None)
    elapsed = time.perf_counter() - t0
    assert [o.value for o in outcomes] == list(range(8)) and most == 4
    # two waves of 0.2 s, not eight in a row (1.6 s); slack for a loaded machine
    assert 0.4 <= elapsed < 1.2
    assert all(o.error is None and o.time_s >= 0.2 for o in outcomes)


def test_a_hung_call_is_abandoned_at_its_timeout_and_frees_its_thread() -> None:
    release = threading.Event()

    def hang() -> None:
        release.wait(30)

    t0 = time.perf_counter()
    outcomes = run_calls([hang, lambda: 1, lambda: 2], threads=1, timeout_s=0.3)
    assert time.perf_counter() - t0 < 2  # one thread: the others ran after the hung one's 0.3 s
    release.set()
    assert outcomes[0].value is None and outcomes[0].error == "timed out after 0.3 s"
    assert [(o.value, o.error) for o in outcomes[1:]] == [(1, None), (2, None)]


def test_a_raising_call_is_its_first_line() -> None:
    def boom() -> None:
        raise ValueError("bad guess\nmore detail")

    assert run_calls([boom], 2, 1.0)[0].error == "ValueError: bad guess"
    assert (
        error_line(KeyError("k")) == "KeyError: 'k'"
        and error_line(RuntimeError()) == "RuntimeError"
    )
