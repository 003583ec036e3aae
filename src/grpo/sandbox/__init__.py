"""Run untrusted Python where it cannot reach the trainer, and judge it from another process.

Two entry points:

- :func:`run_python` runs a program (``main.py``) with stdin and returns what it printed: the
  sandboxed Python tool of multi-turn rollouts and the stdin/stdout tests of the code reward.
- :func:`judge_calls` runs a program as a *candidate* and the row's test code in a separate
  *judge* process; the judge calls the candidate's functions through proxies that exchange plain
  serialized values (``_wire.py``), and reports each test's verdict on a pipe that only it
  holds. Nothing the candidate prints, writes or leaves behind can change the verdict.

Every sandboxed process starts in ``_boot.py`` (its docstring lists each layer): fresh PID,
mount, network, IPC and UTS namespaces (through a user namespace when the trainer is not root),
a private size-capped ``/tmp`` as its working directory, the trainer's home, working directory and
temp folders masked, rlimits, a per-run uid as root (no capabilities otherwise), and Landlock.
Memory is capped by a cgroup per process where the machine lets the trainer create one (cgroup v2
with the memory controller, else v1's memory and pids hierarchies); otherwise by RLIMIT_AS plus
size caps on every file system the run can write (tmpfs sizes, RLIMIT_FSIZE per file including
memfds, RLIMIT_NOFILE). When a run returns, every process it started is gone: the trainer kills
the first process of its PID namespace (the kernel then kills the rest) and waits until the
keeper outside the namespace has reaped it. A fork server, started once per trainer process,
forks each run's keeper.
docs/rewards.md, "Code sandbox (code)", states the threat model.
"""

from grpo.sandbox.limits import Limits, SandboxResult, Verdict
from grpo.sandbox.mounts import interpreter_folders, mount_plan
from grpo.sandbox.process import SandboxUnavailable
from grpo.sandbox.run import judge_calls, run_limited, run_python

__all__ = [
    "Limits",
    "SandboxResult",
    "SandboxUnavailable",
    "Verdict",
    "interpreter_folders",
    "judge_calls",
    "mount_plan",
    "run_limited",
    "run_python",
]
