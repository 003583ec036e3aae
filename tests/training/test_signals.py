"""Stopping on SIGINT / SIGTERM: the first asks for a stop after the step, a second Ctrl-C stops
at once; the handlers are put back after the run. Real signals, sent to this process."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from grpo.training.signals import StopSignals, TrainingStopped

ANNOUNCED = (
    "grpo: {}: stopping after this step and writing a checkpoint (Ctrl-C again stops at once)\n"
)


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)  # Python runs the handler before the next line


def test_sigterm_asks_for_a_stop_once_and_says_so_once(capsys) -> None:
    with StopSignals() as stop:
        assert stop.signum == 0
        _send(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        _send(signal.SIGTERM)  # again: still the same stop, nothing more said
        assert stop.signum == signal.SIGTERM
    assert capsys.readouterr().err == ANNOUNCED.format("SIGTERM")


def test_a_second_sigint_stops_at_once(capsys) -> None:
    with StopSignals() as stop:
        _send(signal.SIGINT)
        assert stop.signum == signal.SIGINT  # the first: after this step
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
    assert capsys.readouterr().err == ANNOUNCED.format("SIGINT")


def test_a_sigint_after_a_sigterm_stops_at_once_too() -> None:
    with StopSignals(announce=False) as stop, pytest.raises(KeyboardInterrupt):
        _send(signal.SIGTERM)
        _send(signal.SIGINT)
    assert stop.signum == signal.SIGTERM


def test_other_ranks_stop_without_a_word(capsys) -> None:
    with StopSignals(announce=False) as stop:
        _send(signal.SIGTERM)
    assert stop.signum == signal.SIGTERM and capsys.readouterr().err == ""


def test_the_previous_handlers_come_back() -> None:
    before = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    with StopSignals() as stop:
        assert all(signal.getsignal(s) == stop._handle for s in StopSignals.SIGNALS)
    assert {s: signal.getsignal(s) for s in StopSignals.SIGNALS} == before


def test_outside_the_main_thread_no_handler_is_installed() -> None:
    # Python lets only the main thread install handlers: elsewhere the stop is a no-op
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def enter() -> None:
        with StopSignals():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before]


def test_a_stopped_run_names_its_signal_step_and_checkpoint() -> None:
    after = TrainingStopped(signal.SIGTERM, 3, Path("runs/x/checkpoints/step-3"), False)
    assert str(after) == "stopped by SIGTERM after step 3: runs/x/checkpoints/step-3 is complete"
    assert (after.signum, after.step, after.exit_code) == (signal.SIGTERM, 3, 143)
    at_once = TrainingStopped(signal.SIGINT, 1, None, True)
    assert str(at_once) == (
        "stopped by SIGINT at once (second Ctrl-C) in step 1: no checkpoint was written"
    )
    assert at_once.exit_code == 130
