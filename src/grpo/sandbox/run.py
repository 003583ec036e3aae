"""The sandbox's entry points: a program run with stdin (``run_python``, ``run_limited``), and a
program judged by tests in a separate process (``judge_calls``)."""

from __future__ import annotations

import json
import os
import time

from grpo.sandbox.limits import Limits, SandboxResult, Verdict
from grpo.sandbox.process import Process, drain, pump, result_of, start

VERDICT_BYTES = 1 << 20


def run_limited(source: str, stdin: str, limits: Limits) -> SandboxResult:
    """:func:`run_python` with every limit of :class:`Limits`."""
    process = start("script", source, stdin, limits, {})
    deadline = time.monotonic() + limits.wall_s
    try:
        streams = {process.stdout: bytearray(), process.stderr: bytearray()}
        caps = dict.fromkeys(streams, limits.output_bytes)
        timed_out = pump(streams, caps, process.ctl.sock.fileno(), deadline)
        process.stop()
        process.finish()
        drain(streams, caps)
        out, err = bytes(streams[process.stdout]), bytes(streams[process.stderr])
        return result_of(process, out, err, timed_out, limits)
    finally:
        process.stop()
        process.release()


def run_python(
    code: str,
    *,
    stdin: str = "",
    wall_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 1024,
    output_bytes: int = 1 << 20,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox and return what it printed.

    ``stdin`` is the program's standard input. The run is stopped after ``wall_s`` seconds
    (``timed_out``) or ``cpu_s`` CPU seconds; everything it holds (heap, files, shared memory)
    stays within ``memory_mb``; each of stdout and stderr keeps its first ``output_bytes``.
    The working directory is a private, empty ``/tmp``. Every process the run started is gone
    when this returns. Raises :class:`SandboxUnavailable` where no sandbox can be built.
    """
    limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, output_bytes=output_bytes)
    return run_limited(code, stdin, limits)


def judge_calls(
    program: str,
    tests: list[str],
    *,
    prefix: str | None = None,
    entry_point: str | None = None,
    limits: Limits = Limits(),
) -> Verdict:
    """Run ``program`` as a candidate and ``tests`` (Python snippets: asserts, or HumanEval's
    ``check`` script) in a separate judge process that calls the candidate's functions by name.

    ``prefix`` is trusted code run in the judge before the tests (HumanEval's prompt, whose
    helpers some checks use); ``entry_point`` always names the candidate's function there.
    """
    calls_r, calls_w = os.pipe()  # judge -> candidate
    replies_r, replies_w = os.pipe()  # candidate -> judge
    verdict_r, verdict_w = os.pipe()  # judge -> trainer
    started: list[Process] = []
    try:
        started.append(
            start("candidate", program, "", limits, {"calls_in": calls_r, "calls_out": replies_w})
        )
        task = json.dumps({"tests": tests, "prefix": prefix, "entry_point": entry_point})
        judge_fds = {"calls_in": replies_r, "calls_out": calls_w, "verdict": verdict_w}
        started.append(start("judge", "", task, limits, judge_fds))
        for fd in (calls_r, calls_w, replies_r, replies_w, verdict_w):
            os.close(fd)
        calls_r = calls_w = replies_r = replies_w = verdict_w = -1
        deadline = time.monotonic() + limits.wall_s
        candidate, judge = started
        caps = {
            candidate.stdout: limits.output_bytes,
            candidate.stderr: limits.output_bytes,
            judge.stdout: 0,
            judge.stderr: limits.output_bytes,
            verdict_r: VERDICT_BYTES,
        }
        streams = {fd: bytearray() for fd in caps}
        timed_out = pump(streams, caps, judge.ctl.sock.fileno(), deadline)
        for process in started:
            process.stop()
            process.finish()
        drain(streams, caps)
        lines = bytes(streams[verdict_r]).decode(errors="replace").splitlines()
        passed = {int(line[5:]) for line in lines if line[:5] == "pass " and line[5:].isdigit()}
        out, err = bytes(streams[candidate.stdout]), bytes(streams[candidate.stderr])
        return Verdict(
            passed=sorted(i for i in passed if i < len(tests)),
            candidate=result_of(candidate, out, err, timed_out, limits),
            judge_stderr=bytes(streams[judge.stderr]).decode(errors="replace"),
            finished="done" in lines,
        )
    finally:
        for fd in (calls_r, calls_w, replies_r, replies_w, verdict_w, verdict_r):
            if fd >= 0:
                os.close(fd)
        for process in started:
            process.stop()
            process.release()
