"""Tools a policy can call during a multi-turn rollout: the sandboxed Python tool.

A call is a Python snippet; it runs in the same sandbox as the ``code`` reward (a child process
with CPU, memory, file-size and process limits, no network, a throw-away directory), with the
tool's own wall-clock and output caps. Each call is a fresh process: variables do not carry over
from one call to the next. As in a notebook, a snippet whose last statement is an expression
prints that expression's value.

What the model sees is ``ToolResult.observation``: the program's standard output, followed by an
``Error:`` line when the call failed (an exception, a time or CPU limit, output past the cap).
A call that hangs or floods its output is cut at its limits, reported to the model that way, and
the rollout goes on.
"""

from __future__ import annotations

import ast
import io
import math
import signal
import time
from dataclasses import dataclass

from grpo.sandbox import run_python

# exit by a signal: the sandbox's CPU limit sends SIGXCPU (or SIGKILL past the hard limit)
SIGNAL_NAMES = {
    -9: "killed by SIGKILL (CPU time or memory limit, or a kill)",
    -24: "CPU time limit",
}


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome. ``error`` is None when the program ran to completion."""

    output: str
    error: str | None
    time_s: float

    @property
    def observation(self) -> str:
        """The text shown to the model."""
        if self.error is None:
            return self.output
        return f"{self.output}\nError: {self.error}" if self.output else f"Error: {self.error}"


def notebook_source(code: str) -> str:
    """``code`` with its last statement printed when it is a bare expression (not a call that
    returns None, like ``print(x)``). Code that does not parse runs as it is, so the model sees
    Python's own SyntaxError."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    # the parser's lines (\n, \r\n, \r), not str.splitlines' (which also splits at U+2028 or a
    # form feed inside a string); its column is a count of UTF-8 bytes
    lines = io.StringIO(code, newline="").readlines()
    start = lines[last.lineno - 1].encode()[: last.col_offset].decode()
    head = "".join(lines[: last.lineno - 1]) + start
    expr = ast.get_source_segment(code, last.value)
    return f"{head}__value = ({expr})\nif __value is not None:\n    print(repr(__value))\n"


def last_error_line(stderr: str) -> str:
    """The exception line of a traceback ('ZeroDivisionError: division by zero')."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "the program failed without a message"


@dataclass(frozen=True)
class PythonTool:
    """Runs snippets in the sandbox: ``timeout_s`` wall clock (CPU limit the same, rounded up),
    ``max_output_chars`` of standard output shown, ``memory_mb`` address space."""

    timeout_s: float = 5.0
    max_output_chars: int = 1000
    memory_mb: int = 1024

    def __call__(self, code: str) -> ToolResult:
        t0 = time.perf_counter()
        result = run_python(
            notebook_source(code),
            wall_s=self.timeout_s,
            cpu_s=max(1, math.ceil(self.timeout_s)),
            memory_mb=self.memory_mb,
            # stdout past the cap is only read to tell a flood from output that fits exactly;
            # stderr needs room for a whole traceback (its last line is the error)
            output_bytes=max(1 << 16, 4 * self.max_output_chars + 4),
        )
        elapsed = time.perf_counter() - t0
        output = result.stdout.rstrip("\n")
        errors = []
        if len(output) > self.max_output_chars:
            output = output[: self.max_output_chars]
            errors.append(f"output cut at {self.max_output_chars} characters")
        if result.timed_out:
            errors.append(f"timed out after {self.timeout_s:g} s")
        elif result.exit_code in SIGNAL_NAMES:
            errors.append(SIGNAL_NAMES[result.exit_code])
        elif result.exit_code is not None and result.exit_code < 0:  # any other signal
            errors.append(f"ended by {signal.Signals(-result.exit_code).name}")
        elif result.exit_code:
            errors.append(last_error_line(result.stderr))
        return ToolResult(output, "; ".join(errors) or None, elapsed)


TOOLS = {"python": PythonTool}
