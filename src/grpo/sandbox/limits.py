"""What a sandboxed run may use, and what it leaves behind."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed process (a judged program gets them twice: candidate
    and judge each)."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    max_procs: int = 32
    output_bytes: int = 1 << 20


@dataclass
class SandboxResult:
    """What a run left behind.

    ``exit_code`` is None when the run was stopped at the wall-clock limit (``timed_out``), and
    negative (``-signal``) when a signal ended it; ``error`` says why a run did not end on its own
    terms (None when it did); stdout and stderr keep their first ``output_bytes`` each.
    ``isolation`` lists the layers the bootstrap applied. ``pid`` is the run's first process (PID
    1 of its namespace ``pidns``, ``pid:[inode]``; every other process of the run died with it)
    and ``uid`` its per-run uid (root only): what leak checks look for.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    error: str | None = None
    isolation: list[str] = field(default_factory=list)
    pidns: str = ""
    pid: int | None = None
    uid: int | None = None


@dataclass
class Verdict:
    """A judged program: the indices of the tests that passed (reported by the judge alone),
    the candidate's run, and whether the judge finished before the wall-clock limit."""

    passed: list[int]
    candidate: SandboxResult
    judge_stderr: str
    finished: bool
