"""The code sandbox against adversarial programs: each ends with reward 0, the trainer process
untouched, and no process of the run left alive."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

import pytest

from grpo.rewards.code import code_reward, extract_code, with_prefix
from grpo.rewards.sandbox import Limits, hidden_interpreter_folders, run_python

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
FAST = Limits(cpu_s=2, wall_s=4, memory_mb=512, max_procs=16)


def _sandbox_uid_processes() -> list[int]:
    # per-run uids start at 1_000_000 (root) — any live one after a run is a leak
    leaked = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) >= 1_000_000 and fields["State"].split()[0] != "Z":
            leaked.append(int(entry))
    return leaked


def _score(program: str, tests: list[str] = TESTS, mode: str = "binary") -> float:
    fn = code_reward(
        mode=mode, cpu_s=FAST.cpu_s, wall_s=FAST.wall_s, memory_mb=FAST.memory_mb, max_procs=16
    )
    return fn([f"```python\n{program}\n```"], tests=[tests])[0]


GOOD = "def add(a, b):\n    return a + b"


def test_correct_program_passes_and_fraction_counts_tests():
    assert _score(GOOD) == 1.0
    # a - b: 1-2=-1 != 3, -1-1=-2 != 0, 10-5=5 != 15 -> 0 of 3
    assert _score("def add(a, b):\n    return a - b", mode="fraction") == 0.0
    # wrong only for a < 0 -> fails add(-1, 1) alone: 2 of 3 pass
    program = "def add(a, b):\n    return 99 if a < 0 else a + b"
    assert _score(program, mode="fraction") == pytest.approx(2 / 3)
    assert _score(program, mode="binary") == 0.0


ADVERSARIAL = {
    "infinite_loop": "while True:\n    pass\n" + GOOD,
    "sleep_forever": "import time\ntime.sleep(3600)\n" + GOOD,
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    + GOOD,
    "allocate_10gb": "x = bytearray(10 * 1024**3)\n" + GOOD,
    "exit_early_to_fake_a_pass": "import os\nos._exit(0)\n" + GOOD,
    "sys_exit": "import sys\nsys.exit(0)\n" + GOOD,
    "escaped_child_sleeps": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n"
    + "raise SystemExit(1)\n"
    + GOOD,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_program_scores_zero_and_leaves_nothing(name: str):
    assert _score(ADVERSARIAL[name]) == 0.0
    assert _sandbox_uid_processes() == []


def test_writing_outside_the_workdir_fails(tmp_path: Path):
    target = tmp_path / "pwned.txt"
    program = f"open({str(target)!r}, 'w').write('x')\n" + GOOD
    assert _score(program) == 0.0
    assert not target.exists()
    # /tmp is world-writable, yet the sandbox cannot write there either
    shared = Path("/tmp") / f"grpo-sandbox-escape-{os.getpid()}"
    assert _score(f"open({str(shared)!r}, 'w').write('x')\n" + GOOD) == 0.0
    assert not shared.exists()


def test_socket_cannot_reach_a_listening_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted: list[object] = []
    server.settimeout(3)

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    thread = threading.Thread(target=accept)
    thread.start()
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n" + GOOD
    assert _score(program) == 0.0
    thread.join()
    server.close()
    assert accepted == []


def test_secret_in_trainer_environment_is_invisible(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    program = (
        "import os\n"
        "assert 'GRPO_TEST_SECRET' not in os.environ\n"
        f"environ = open('/proc/{os.getpid()}/environ', 'rb').read()\n" + GOOD  # must raise
    )
    assert _score(program) == 0.0
    # the environment check alone passes: the variable is not there
    result = run_python("import os\nprint('GRPO_TEST_SECRET' in os.environ)")
    assert result.stdout.strip() == "False"


def test_signalling_the_parent_does_not_reach_the_trainer():
    program = f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n" + GOOD
    assert _score(program) == 0.0  # we are still here to check it
    program = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + GOOD
    assert _score(program) == 0.0


def test_isolation_layers_reported():
    result = run_python("print('ok')")
    assert result.stdout == "ok\n"
    assert "rlimits" in result.isolation
    if os.geteuid() == 0:
        assert "netns" in result.isolation
        assert any(layer.startswith("uid=") for layer in result.isolation)


def test_wall_clock_timeout_and_cleanup():
    result = run_python("import time\ntime.sleep(60)", wall_s=1)
    assert result.timed_out and result.exit_code is None
    assert _sandbox_uid_processes() == []


def test_output_is_capped():
    result = run_python("print('x' * 5000)", output_bytes=100)
    assert len(result.stdout) == 100


def test_hidden_interpreter_folders_are_closed_ancestors():
    for closed, inner in hidden_interpreter_folders():
        assert Path(inner).is_relative_to(closed)
        assert not Path(closed).stat().st_mode & 0o001


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Here:\n```python\nx = 1\n```\nand\n```py\nx = 2\n```", "x = 2\n"),
        ("<think>plan</think><answer>x = 3</answer>", "x = 3"),
        ("<think>plan</think>\nx = 4\n", "x = 4"),
    ],
)
def test_extract_code(text: str, expected: str):
    assert extract_code(text) == expected


def test_prefix_added_only_when_the_function_is_missing():
    prefix = "def add(a, b):\n"
    assert with_prefix("    return a + b\n", prefix, "add") == prefix + "    return a + b\n"
    assert with_prefix(GOOD, prefix, "add") == GOOD


def test_run_python_reads_stdin_and_reports_the_exit_code():
    result = run_python("import sys\nn = int(input())\nprint(n * 2)\nsys.exit(3)", stdin="21\n")
    assert (result.stdout, result.exit_code, result.timed_out, result.error) == (
        "42\n",
        3,
        False,
        None,
    )
