"""The sandboxed Python tool: what a call shows the model, its limits, its isolation."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from faults import record

import grpo.sandbox.process
from grpo.rollout.tools import PythonTool, last_error_line, notebook_source
from grpo.sandbox.fork_server import FORK_SERVER


def test_python_tool_prints_output_and_the_last_expression() -> None:
    tool = PythonTool(timeout_s=5)
    assert tool("print(12 * 34)").observation == "408"
    # like a notebook, a final bare expression is shown
    assert tool("x = 12\nx * 34").observation == "408"
    assert tool("print('a')\nNone").observation == "a"


def test_notebook_source_leaves_statements_and_bad_syntax_alone() -> None:
    assert notebook_source("x = 1") == "x = 1"
    assert notebook_source("def f(:") == "def f(:"
    assert "print(repr(__value))" in notebook_source("1 + 1")


def test_notebook_source_prints_the_last_expression_of_several_lines() -> None:
    shown = "\nif __value is not None:\n    print(repr(__value))\n"
    assert notebook_source("a = 1\nb = 2\na + b") == "a = 1\nb = 2\n__value = (a + b)" + shown
    # after a semicolon: the statements before it on its line stay
    assert notebook_source("a = 1\nb = 2; a + b") == "a = 1\nb = 2; __value = (a + b)" + shown


def test_notebook_source_counts_lines_and_columns_as_the_parser_does() -> None:
    tool = PythonTool(timeout_s=5)
    # a line separator or form feed inside a string is no line end; a column counts UTF-8 bytes
    assert tool('s = "a\u2028b\x0cc"\nlen(s)').observation == "5"
    assert tool('x = "é"; len(x)').observation == "1"
    assert tool("x = 2\r\nx * 21").observation == "42"


def test_a_program_that_exits_with_a_message_shows_it() -> None:
    assert PythonTool(timeout_s=5)("raise SystemExit('bye')").error == "bye"
    ended = PythonTool(timeout_s=5)("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert ended.error == "ended by SIGTERM"


def test_python_tool_errors_are_one_line_for_the_model() -> None:
    result = PythonTool(timeout_s=5)("print(1)\n1 / 0")
    assert result.output == "1"
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.observation == "1\nError: ZeroDivisionError: division by zero"


def test_a_failure_without_stderr_still_tells_the_model_it_failed() -> None:
    traceback = "Traceback (most recent call last):\n  ...\nValueError: bad\n\n"
    assert last_error_line(traceback) == "ValueError: bad"
    assert last_error_line("") == "the program failed without a message"
    assert last_error_line(" \n\n") == "the program failed without a message"


def test_a_hanging_call_is_cut_at_its_time_limit() -> None:
    result = PythonTool(timeout_s=1)("import time\ntime.sleep(60)")
    assert result.error == "timed out after 1 s"
    assert result.time_s < 10


def test_a_flooding_call_is_cut_at_its_output_cap() -> None:
    result = PythonTool(timeout_s=2, max_output_chars=100)("while True:\n    print('x' * 50)")
    assert len(result.output) == 100
    assert result.error.startswith("output cut at 100 characters")
    fits = PythonTool(timeout_s=5, max_output_chars=100)("print('y' * 100)")
    assert fits.output == "y" * 100 and fits.error is None


def test_the_tool_cannot_reach_the_network_or_the_trainers_files(tmp_path: Path) -> None:
    # the same sandbox as the code reward (its adversarial suite is tests/sandbox/test_sandbox.py)
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    tool = PythonTool(timeout_s=5)
    wrote = tool(f"open({str(secret)!r}, 'w').write('pwned')")
    assert wrote.error is not None and secret.read_text() == "s3cret"
    net = tool("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")
    assert net.error is not None


# ---------------------------------------------------------------- the fault matrix's cells
# (docs/checkpoints.md): the tool's program, and the trainer's fork server behind it, killed,
# stopped, or answering garbage. A call ends within its limit and tells the model why; the
# rollout (and the run) goes on


@pytest.mark.parametrize(
    ("fault", "program", "error"),
    [
        (
            "kill",
            "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
            "killed by SIGKILL (CPU time or memory limit, or a kill)",
        ),
        ("stop", "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", "timed out after 2 s"),
    ],
)
def test_a_killed_or_stopped_program_is_an_error_for_the_model(
    fault: str, program: str, error: str
) -> None:
    result = PythonTool(timeout_s=2)(program)
    assert result.error == error and result.output == ""
    assert result.time_s < 2 + 5, result.time_s  # its limit, and a few seconds (generous)
    record(f"python tool/{fault}", result.time_s, result.observation)


def test_garbage_output_reaches_the_model_as_text() -> None:
    # every byte value, invalid UTF-8 included: decoded with replacement characters
    result = PythonTool(timeout_s=2)("import sys\n_ = sys.stdout.buffer.write(bytes(range(256)))")
    assert result.error is None
    assert result.output == bytes(range(128)).decode() + "\ufffd" * 128
    record("python tool/garbage", result.time_s, result.observation[:40])


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_killed_or_stopped_fork_server_is_replaced(fault: str) -> None:
    tool = PythonTool(timeout_s=2)
    assert tool("1 + 1").output == "2"
    os.kill(FORK_SERVER._proc.pid, {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[fault])
    old = FORK_SERVER._proc
    t0 = time.monotonic()
    result = tool("2 + 2")
    seconds = time.monotonic() - t0
    # either fails the next run's start at once, not after the start's limit (60 s, which is
    # there for a machine under load): the call runs on a new server
    assert result.output == "4" and result.error is None
    assert FORK_SERVER._proc is not old and old.poll() is not None  # replaced, and gone
    assert seconds < grpo.sandbox.process.STARTUP_TIMEOUT_S / 4, seconds
    record(f"python tool/fork server {fault}", seconds, result.observation)
