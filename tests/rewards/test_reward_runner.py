"""The reward runner: user functions in killable worker processes, failures that are seen (first
error printed, counts per step, a stop after repeated failure), hangs and leaks bounded."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import yaml
from faults import record

import grpo.rewards.runner
from grpo.config import RewardsConfig, RewardSpec
from grpo.rewards import (
    REGISTRY,
    ErrorWatch,
    RewardError,
    RewardFailure,
    RewardRunner,
    resolve_reward,
)
from grpo.rewards.pool import Outcome

USER_REWARDS = """
import math, os, time
def flaky(completions, **kw):
    if completions[0] == "boom":
        raise ValueError("bad completion " + completions[0])
    return [None if completions[0] == "skip" else 0.25]
def raises(completions, **kw):
    raise ValueError("always broken")
def wrong_length(completions, **kw):
    return [1.0, 2.0]
def nan(completions, **kw):
    return [math.nan]
def past_float32(completions, **kw):
    return [1e39]
def past_float(completions, **kw):
    return [10**400]
def string(completions, **kw):
    return ["1.0"]
def scalar(completions, **kw):
    return 1.0
def generator(completions, **kw):
    return (1.0 for _ in completions)
def crash(completions, **kw):
    os._exit(3)  # as a segfault in a C extension would end the process
def prompts_first(prompts, completions, **kw):
    import numpy, torch
    values = {"b": numpy.bool_(True), "t": torch.tensor(0.5), "f": numpy.float32(0.25)}
    return [values[completions[0]]]
def group_relative(completions, answer, **kw):
    # each completion against the batch's mean length, as a group-relative reward is
    mean = sum(map(len, completions)) / len(completions)
    return [len(c) - mean for c in completions]
group_relative.batched = True
def named_otherwise(texts, **kw):
    return [float(len(texts[0]))]
def pid(completions, **kw):
    return [os.getpid()]
def spawn_and_hang(completions, **kw):
    import subprocess
    child = subprocess.Popen(["sleep", "300"])
    with open(completions[0], "w") as f:
        f.write(str(child.pid))
    time.sleep(1000)
def hang(completions, **kw):
    if completions[0] == "hang":
        time.sleep(1000)
    return [1.0]
HOARD = []
def leak(completions, **kw):
    HOARD.append(b"x" * (40 << 20))  # 40 MiB per call, never freed
    return [os.getpid()]
def balloon(completions, **kw):
    block = b"x" * (300 << 20)
    time.sleep(30)
    return [len(block)]
def fault(completions, **kw):
    # the fault matrix's cells: the worker killed, stopped, or answering garbage on its pipe
    import signal, struct, sys
    from multiprocessing.connection import Connection
    to_trainer = int(sys.argv[2])  # the worker's end of its answers' pipe
    if completions[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if completions[0] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if completions[0] == "garbage":
        os.write(to_trainer, struct.pack("!i", 7) + b"garbage")
        time.sleep(30)
    if completions[0] == "huge":  # a forged length of 2 GB, then bytes as fast as they go
        os.write(to_trainer, struct.pack("!i", 2**31 - 1))
        while True:
            os.write(to_trainer, b"x" * 65536)
    if completions[0] == "part":  # a frame's length, and then nothing
        os.write(to_trainer, struct.pack("!i", 64) + b"garb")
        time.sleep(30)
    if completions[0] == "not-an-answer":
        Connection(to_trainer, readable=False).send(("ok", "1.0"))
        time.sleep(30)
    if completions[0] in ("too-many", "strings"):
        values = [1.0, 2.0] if completions[0] == "too-many" else ["1.0"]
        Connection(to_trainer, readable=False).send(("ok", values))
        time.sleep(30)
    return [1.0]
def sleepy(completions, *, log, **kw):
    start = time.time()
    time.sleep(0.3)
    with open(log[0], "a") as f:
        f.write(f"{os.getpid()} {start} {time.time()}\\n")
    return [1.0]
"""


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def _runner(*specs: RewardSpec, **config) -> RewardRunner:
    return RewardRunner(RewardsConfig(functions=list(specs), **config))


def _score(runner: RewardRunner, completions: list[str], **columns):
    n = len(completions)
    return runner(completions, ["p"] * n, {k: [v] * n for k, v in columns.items()}, [[1]] * n)


def test_weights_none_and_errors_with_the_first_error_printed(user_module: Path, capsys):
    runner = _runner(
        RewardSpec(name="format", weight=2.0),
        RewardSpec(name=f"{user_module}:flaky"),
        RewardSpec(name=f"{user_module}:wrong_length"),
        fallback=-0.5,
    )
    try:
        out = _score(runner, ["<think>x</think><answer>1</answer>", "boom", "skip"])
        again = _score(runner, ["boom", "boom"])
    finally:
        runner.close()
    assert out.names == ["format", "flaky", "wrong_length"]
    # row 0: format 1 * 2 + flaky 0.25 + fallback -0.5 = 1.75
    # row 1: format 0 + flaky raised -> -0.5, wrong_length -> -0.5 = -1.0
    # row 2: format 0 + None (as 0) + -0.5 = -0.5
    assert torch.allclose(out.total, torch.tensor([1.75, -1.0, -0.5]))
    assert math.isnan(out.per_function[2, 1])
    assert out.errors == {"format": 0, "flaky": 1, "wrong_length": 3}
    assert again.errors == {"format": 0, "flaky": 2, "wrong_length": 2}
    err = capsys.readouterr().err
    # each function's first error once, with the user's traceback and its message
    assert err.count("reward 'flaky' raised") == 1 and err.count("Traceback") == 1
    assert "ValueError: bad completion boom" in err and "user_rewards.py" in err
    assert err.count("reward 'wrong_length' returned 2 values for 1 completions") == 1


def test_built_ins_score_the_completions_token_ids():
    runner = _runner(RewardSpec(name="token_budget", args={"budget": 1, "per_token": 0.25}))
    try:
        out = runner(["a", "b", "c"], ["p"] * 3, {}, [[7], [7, 8], [7, 8, 9, 10]])
    finally:
        runner.close()
    assert out.errors == {"token_budget": 0}
    assert out.per_function[:, 0].tolist() == [0.0, -0.25, -0.75]


def test_a_built_in_that_returns_a_malformed_value_scores_the_fallback(monkeypatch, capsys):
    monkeypatch.setitem(REGISTRY, "two_values", lambda: lambda completions, **_: [1.0, 2.0])
    runner = _runner(RewardSpec(name="two_values"), RewardSpec(name="format"), fallback=-0.5)
    try:
        out = _score(runner, ["a", "b"])
        _score(runner, ["c"])
    finally:
        runner.close()
    assert out.errors == {"two_values": 2, "format": 0}
    assert out.per_function[:, 0].tolist() == [-0.5, -0.5]
    err = capsys.readouterr().err
    line = "reward 'two_values' returned 2 values for 1 completions (its first malformed value"
    assert err.count(line) == 1


def test_completions_no_function_scored_are_said_once(monkeypatch, capsys):
    # None is "does not apply" (TRL's contract); when every function says so, the completion
    # trains on a total of 0, which the user must hear of
    monkeypatch.setitem(
        REGISTRY,
        "odd_only",
        lambda: lambda completions, **_: [None if "b" in c else 1.0 for c in completions],
    )
    runner = _runner(RewardSpec(name="odd_only"))
    try:
        out = _score(runner, ["a", "b", "bb"])
        _score(runner, ["b"])
        assert _score(runner, ["a"]).per_function.tolist() == [[1.0]]
    finally:
        runner.close()
    assert out.total.tolist() == [1.0, 0.0, 0.0]
    assert capsys.readouterr().err.strip().splitlines() == [
        "rewards: every function returned None for 2 of 3 completions, which score a total "
        "reward of 0 (said once; counted per step in reward/unscored_frac)"
    ]


def test_a_built_in_that_raises_scores_the_fallback_alone_with_its_traceback_once(
    monkeypatch, capsys
):
    def picky(completions, **_):
        if completions[0] == "boom":
            raise ValueError("cannot score boom")
        return [1.0]

    monkeypatch.setitem(REGISTRY, "picky", lambda: picky)
    runner = _runner(RewardSpec(name="picky"), RewardSpec(name="format"), fallback=-0.5)
    try:
        out = _score(runner, ["boom", "fine", "boom"])
    finally:
        runner.close()
    # one call per completion: only the two that raised score the fallback, and the other
    # function still scores every row
    assert out.per_function.tolist() == [[-0.5, 0.0], [1.0, 0.0], [-0.5, 0.0]]
    assert out.errors == {"picky": 2, "format": 0}
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "reward 'picky' raised (its first error; later ones are counted per step):"
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: cannot score boom"  # the traceback, no blank line after it
    assert sum(line.startswith("reward ") for line in lines) == 1


def test_a_batched_built_in_scores_the_whole_batch_in_one_call(monkeypatch):
    calls: list[int] = []

    def in_batch(completions, *, answer, **_):
        # a batch-relative score, as a reward model's can be: the batch's size where the
        # completion is its row's answer
        calls.append(len(completions))
        return [
            float(len(completions) * (c == a)) for c, a in zip(completions, answer, strict=True)
        ]

    in_batch.batched = True
    monkeypatch.setitem(REGISTRY, "in_batch", lambda: in_batch)
    runner = _runner(RewardSpec(name="in_batch"), RewardSpec(name="format"))
    try:
        completions = ["1", "<think>t</think><answer>2</answer>", "3"]
        out = runner(completions, ["p"] * 3, {"answer": ["1", "0", "3"]}, [[1]] * 3)
    finally:
        runner.close()
    # one call with all 3 completions (one at a time it would score 1, not 3), and the next
    # function still scores each row
    assert calls == [3]
    assert out.per_function.tolist() == [[3.0, 0.0], [0.0, 1.0], [3.0, 0.0]]
    assert out.errors == {"in_batch": 0, "format": 0}


def test_scores_are_float32_whatever_the_default_dtype():
    runner = _runner(RewardSpec(name="format"))
    torch.set_default_dtype(torch.float64)
    try:
        out = _score(runner, ["<think>t</think><answer>2</answer>", "x"])
    finally:
        torch.set_default_dtype(torch.float32)
        runner.close()
    assert out.per_function.dtype == torch.float32
    assert out.per_function.tolist() == [[1.0], [0.0]]


def test_resolve_reward_loads_a_user_function_into_this_process(user_module: Path):
    fn = resolve_reward(RewardSpec(name=f"{user_module}:flaky"))
    assert fn(["a"]) == [0.25] and fn(["skip"]) == [None]
    with pytest.raises(RewardError, match="args are only for built-in rewards"):
        resolve_reward(RewardSpec(name=f"{user_module}:flaky", args={"scale": 2}))
    with pytest.raises(RewardError) as raised:
        resolve_reward(RewardSpec(name=f"{user_module}:nope"))
    assert (
        str(raised.value)
        == f"reward '{user_module}:nope': 'nope' is not a function in {user_module}"
    )


def test_a_user_function_is_named_after_the_last_colon(tmp_path: Path):
    # a directory may have a colon in its name (a time of day): the function is what follows
    # the last one, and that is the name its scores and errors are reported under
    folder = tmp_path / "run-12:30"
    folder.mkdir()
    (folder / "rewards.py").write_text("def score(completions, **kw):\n    return [0.5]\n")
    runner = _runner(RewardSpec(name=f"{folder}/rewards.py:score"), workers=1)
    try:
        out = _score(runner, ["a"])
    finally:
        runner.close()
    assert out.names == ["score"] and out.errors == {"score": 0}
    assert out.per_function.tolist() == [[0.5]]


class ScriptedPool:
    """A WorkerPool stand-in whose calls end as the script says: every outcome kind, no timing."""

    script: ClassVar[list[Outcome]] = []

    def __init__(
        self, names: list[str], workers: int, max_rss_mb: float, args: list | None = None
    ) -> None:
        self.batched = [False] * len(names)

    def run(self, calls: list, timeout_s: float) -> list[Outcome]:
        assert len(calls) == len(self.script)
        return self.script

    def close(self) -> None:
        pass


def test_each_kind_of_worker_outcome_scores_and_prints_its_own_line(
    user_module: Path, monkeypatch, capsys
):
    monkeypatch.setattr(grpo.rewards.runner, "WorkerPool", ScriptedPool)
    monkeypatch.setattr(
        ScriptedPool,
        "script",
        [
            Outcome("ok", values=[0.5], recycled=True),
            Outcome("timeout", detail="a call still ran after rewards.timeout_s=1 s"),
            Outcome("memory", detail="its worker passed rewards.max_worker_rss_mb=9 during a call"),
            Outcome("bad", detail="reward 'flaky' returned nan at position 0"),
            Outcome("timeout", detail="again"),
        ],
    )
    runner = _runner(RewardSpec(name=f"{user_module}:flaky"), fallback=-1.0, max_worker_rss_mb=9)
    try:
        out = _score(runner, ["a", "b", "c", "d", "e"])
    finally:
        runner.close()
    assert out.per_function[:, 0].tolist() == [0.5, -1.0, -1.0, -1.0, -1.0]
    assert out.errors == {"flaky": 4}
    later = "(first time; later ones are counted per step)"
    assert capsys.readouterr().err.splitlines() == [
        "reward 'flaky': its worker passed rewards.max_worker_rss_mb=9 after a call, so it was "
        "replaced",
        f"reward 'flaky': a call still ran after rewards.timeout_s=1 s {later}",
        f"reward 'flaky': its worker passed rewards.max_worker_rss_mb=9 during a call {later}",
        "reward 'flaky' returned nan at position 0 (its first malformed value; later ones are "
        "counted per step)",
    ]


def test_two_user_functions_each_score_their_own_column(user_module: Path, monkeypatch):
    monkeypatch.setattr(grpo.rewards.runner, "WorkerPool", ScriptedPool)
    # completion-major calls: (flaky, row 0), (pid, row 0), (flaky, row 1), (pid, row 1)
    monkeypatch.setattr(
        ScriptedPool,
        "script",
        [
            Outcome("ok", values=[0.5]),
            Outcome("ok", values=[2.0]),
            Outcome("ok", values=[None]),
            Outcome("bad", detail="reward 'pid' returned nan at position 0"),
        ],
    )
    runner = _runner(
        RewardSpec(name=f"{user_module}:flaky"),
        RewardSpec(name=f"{user_module}:pid"),
        fallback=-1.0,
    )
    try:
        out = _score(runner, ["a", "b"])
    finally:
        runner.close()
    assert out.per_function[0].tolist() == [0.5, 2.0]
    assert math.isnan(out.per_function[1, 0]) and out.per_function[1, 1] == -1.0
    assert out.errors == {"flaky": 0, "pid": 1}


@pytest.mark.parametrize(
    ("fn", "line"),
    [
        ("raises", "ValueError: always broken"),
        ("wrong_length", "reward 'wrong_length' returned 2 values for 1 completions"),
        ("nan", "reward 'nan' returned nan at position 0"),
        ("past_float32", "reward 'past_float32' returned 1e+39 at position 0; expected a finite"),
        ("past_float", "reward 'past_float' returned inf at position 0"),
        ("string", "reward 'string' returned a str '1.0' at position 0; expected a number"),
        ("scalar", "reward 'scalar' returned a float 1.0; expected a list of 1 numbers"),
        ("generator", "reward 'generator' returned a generator"),
        ("crash", "its worker process died (exit code 3)"),
    ],
)
def test_each_bad_return_is_an_error_with_its_line(user_module: Path, capsys, fn: str, line: str):
    runner = _runner(RewardSpec(name=f"{user_module}:{fn}"), fallback=0.0)
    try:
        out = _score(runner, ["a", "b"])
    finally:
        runner.close()
    assert out.errors == {fn: 2} and out.per_function[:, 0].tolist() == [0.0, 0.0]
    err = capsys.readouterr().err
    assert line in err and err.count(line) == 1


def test_import_errors_are_one_line_at_start(tmp_path: Path, user_module: Path):
    with pytest.raises(RewardError, match=r"'nope' is not a function"):
        _runner(RewardSpec(name=f"{user_module}:nope"))
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'"):
        _runner(RewardSpec(name="no_such_module_xyz:fn"))
    with pytest.raises(RewardError, match="not found"):
        _runner(RewardSpec(name=f"{tmp_path}/missing.py:fn"))


def test_user_functions_run_in_worker_processes_concurrently(user_module: Path, tmp_path: Path):
    log = tmp_path / "calls.log"
    runner = _runner(
        RewardSpec(name=f"{user_module}:sleepy"), RewardSpec(name=f"{user_module}:pid"), workers=2
    )
    try:
        out = _score(runner, ["x"] * 6, log=str(log))
    finally:
        runner.close()
    pids = {int(v) for v in out.per_function[:, 1].tolist()}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len(calls) == 6 and len({pid for pid, *_ in calls}) == 2
    # two calls overlap in time: one started before the other ended
    spans = sorted((float(start), float(end)) for _, start, end in calls)
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans))


def test_a_hanging_call_is_stopped_and_the_step_takes_one_timeout(user_module: Path):
    runner = _runner(RewardSpec(name=f"{user_module}:hang"), timeout_s=2.0, workers=2)
    try:
        t0 = time.monotonic()
        out = _score(runner, ["hang"] * 8)
        elapsed = time.monotonic() - t0
        # 8 hanging calls on 2 workers: all stopped at the step's one time limit (2 s), where
        # one limit per call would take 8 s
        assert out.errors == {"hang": 8} and elapsed < 6.0
        # the killed workers were replaced: the next step scores normally
        out = _score(runner, ["ok", "hang", "ok", "ok"])
        assert out.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0]
        assert out.errors == {"hang": 1}
    finally:
        runner.close()
    assert all(w is None or w.proc.poll() is not None for w in runner.pool.workers)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; its new parent reaps it


def test_a_stopped_call_takes_the_processes_it_started_with_it(user_module: Path, tmp_path):
    runner = _runner(RewardSpec(name=f"{user_module}:spawn_and_hang"), timeout_s=1.0, workers=1)
    pid_file = tmp_path / "child.pid"
    try:
        assert _score(runner, [str(pid_file)]).errors == {"spawn_and_hang": 1}
    finally:
        runner.close()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_a_leaking_worker_is_recycled_past_the_memory_ceiling(user_module: Path, capsys):
    # each call keeps 40 MiB; with a 150 MiB ceiling a worker serves about 3 calls
    runner = _runner(RewardSpec(name=f"{user_module}:leak"), workers=1, max_worker_rss_mb=150)
    try:
        out = _score(runner, ["x"] * 10)
    finally:
        runner.close()
    assert out.errors == {"leak": 0}  # recycling between calls costs no score
    pids = [int(v) for v in out.per_function[:, 0].tolist()]
    assert len(set(pids)) >= 3  # replaced more than once
    assert max(pids.count(p) for p in set(pids)) <= 4  # never past the ceiling for long
    err = capsys.readouterr().err
    assert err.count("reward 'leak': its worker passed rewards.max_worker_rss_mb=150") == 1


def test_a_call_past_the_memory_ceiling_is_killed(user_module: Path, capsys):
    runner = _runner(RewardSpec(name=f"{user_module}:balloon"), workers=1, max_worker_rss_mb=150)
    try:
        t0 = time.monotonic()
        out = _score(runner, ["x"])
        assert time.monotonic() - t0 < 20  # killed, not waited for the 30 s sleep
    finally:
        runner.close()
    assert out.errors == {"balloon": 1}
    assert "passed rewards.max_worker_rss_mb=150 during a call" in capsys.readouterr().err


LATER = "(first time; later ones are counted per step)"


@pytest.mark.parametrize(
    ("fault", "line"),
    [
        ("kill", f"reward 'fault': its worker process died (killed by SIGKILL); replaced {LATER}"),
        (
            "stop",
            "reward 'fault': a call still ran after rewards.timeout_s=2 s; its worker was killed "
            f"and replaced {LATER}",
        ),
        (
            "garbage",
            "reward 'fault': its worker process sent garbage, not an answer; killed and "
            f"replaced {LATER}",
        ),
        (
            "part",
            "reward 'fault': its worker sent part of an answer and no more within "
            f"rewards.timeout_s=2 s; killed and replaced {LATER}",
        ),
        (
            "huge",
            "reward 'fault': its worker process sent garbage, not an answer; killed and "
            f"replaced {LATER}",
        ),
        (
            "not-an-answer",
            "reward 'fault': its worker process sent garbage, not an answer; killed and "
            f"replaced {LATER}",
        ),
        (
            "strings",
            "reward 'fault': its worker process sent garbage, not an answer; killed and "
            f"replaced {LATER}",
        ),
        (
            "too-many",
            "reward 'fault': its worker process sent garbage, not an answer; killed and "
            f"replaced {LATER}",
        ),
    ],
)
def test_a_worker_killed_stopped_or_answering_garbage_fails_its_call_in_one_line(
    user_module: Path, capsys, fault: str, line: str
):
    # the fault matrix's cells for reward workers (docs/checkpoints.md): the call scores the
    # fallback within rewards.timeout_s, one line names the function and the cause, and the
    # next call is served (by a replaced worker); the run goes on
    runner = _runner(RewardSpec(name=f"{user_module}:fault"), timeout_s=2.0, workers=1)
    try:
        t0 = time.monotonic()
        out = _score(runner, [fault])
        seconds = time.monotonic() - t0
        assert out.errors == {"fault": 1} and out.per_function[:, 0].tolist() == [0.0]
        assert seconds < 2.0 + 5.0, seconds  # the step's limit, and a replacement's start
        assert _score(runner, ["ok"]).per_function[:, 0].tolist() == [1.0]
    finally:
        runner.close()
    assert capsys.readouterr().err.splitlines() == [line]
    record(f"reward workers/{fault}", seconds, line)


def test_error_watch_prints_counts_and_stops_when_patience_runs_out(capsys):
    watch = ErrorWatch(max_frac=0.5, patience=2)
    watch.observe(1, {"a": 3, "b": 0}, 4, announce=True)  # a over 0.5: streak 1
    watch.observe(2, {"a": 2, "b": 0}, 4, announce=True)  # 2/4 is not more than half: reset
    watch.observe(3, {"a": 4, "b": 0}, 4, announce=False)  # streak 1, not printed
    with pytest.raises(RewardFailure, match=r"reward 'a' failed on more than .*0\.5.* 2 steps"):
        watch.observe(4, {"a": 3, "b": 1}, 4, announce=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "step 1: reward errors: a 3/4",
        "step 2: reward errors: a 2/4",
        "step 4: reward errors: a 3/4, b 1/4",
    ]
    never = ErrorWatch(max_frac=1.0, patience=1)
    never.observe(1, {"a": 4}, 4, announce=False)  # 1 = never stop


def _train(
    tmp_path: Path, tiny_model_dir: Path, rewards: dict, steps: int, timeout: float, prompts: int
):
    tree = {
        "model": {"name": str(tiny_model_dir), "precision": "float32"},
        "data": {"task": "arithmetic", "task_args": {"size": 16}},
        "rollout": {"prompts_per_step": prompts, "group_size": 4, "max_new_tokens": 4},
        "rewards": rewards,
        "train": {
            "steps": steps,
            "output_dir": str(tmp_path / "runs"),
            "progress": False,
            "sinks": ["jsonl"],
        },
    }
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    grpo = Path(sys.executable).parent / "grpo"
    return subprocess.run(
        [str(grpo), "train", str(recipe)], capture_output=True, text=True, timeout=timeout
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_grpo_train_with_a_reward_that_sleeps_forever(tmp_path: Path, tiny_model_dir: Path):
    hang = tmp_path / "hang.py"
    pids = tmp_path / "pids"
    hang.write_text(
        "import os, time\n"
        "def forever(completions, **kw):\n"
        f"    open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "    time.sleep(100000)\n"
    )
    rewards = {
        "functions": [{"name": "format"}, {"name": f"{hang}:forever"}],
        "timeout_s": 1.0,
        "max_error_frac": 1.0,  # keep going: this test is about time, not the stop rule
    }
    done = _train(tmp_path, tiny_model_dir, rewards, steps=2, timeout=240, prompts=4)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "runs/recipe/metrics.jsonl").open()]
    assert [row["reward/forever/errors"] for row in rows] == [16.0, 16.0]
    # 16 calls on 2 workers, each past the limit: the step's one limit stops the two calls that
    # started and fails the 14 that never did (a limit per call would start all 16, 9 s a step)
    assert "reward 'forever': a call still ran after rewards.timeout_s=1 s" in done.stderr
    assert "step 2: reward errors: forever 16/16" in done.stderr
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2 * 2 and not any(_alive(p) for p in started)


def test_grpo_train_stops_with_one_line_after_patience(tmp_path: Path, tiny_model_dir: Path):
    broken = tmp_path / "broken.py"
    broken.write_text("def boom(completions, **kw):\n    raise KeyError('no such column')\n")
    rewards = {
        "functions": [{"name": "format"}, {"name": f"{broken}:boom"}],
        "error_patience": 2,
    }
    done = _train(tmp_path, tiny_model_dir, rewards, steps=6, timeout=240, prompts=2)
    assert done.returncode == 2
    err = done.stderr.strip().splitlines()
    assert err[-1].startswith("grpo: error: reward 'boom' failed on more than")
    assert "for 2 steps in a row (step 2: 8/8)" in err[-1]
    assert done.stderr.count("Traceback") == 1 and "KeyError: 'no such column'" in done.stderr
    assert [line for line in err if line.startswith("step ")] == [
        "step 1: reward errors: boom 8/8",
        "step 2: reward errors: boom 8/8",
    ]


def test_a_trl_style_reward_is_called_by_keyword_and_may_return_numpy_or_torch_numbers(
    user_module: Path,
):
    runner = _runner(RewardSpec(name=f"{user_module}:prompts_first"))
    try:
        out = _score(runner, ["b", "t", "f"])
    finally:
        runner.close()
    assert out.errors == {"prompts_first": 0}
    assert out.per_function[:, 0].tolist() == [1.0, 0.5, 0.25]
    runner = _runner(RewardSpec(name=f"{user_module}:named_otherwise"))  # f(texts, **kw)
    try:
        assert _score(runner, ["abc"]).per_function[0, 0] == 3.0
    finally:
        runner.close()


def test_a_batched_user_function_scores_the_whole_batch_in_one_call(user_module: Path):
    runner = _runner(
        RewardSpec(name=f"{user_module}:group_relative"), RewardSpec(name=f"{user_module}:pid")
    )
    try:
        out = _score(runner, ["a", "abc", "abcde"], answer="1")
    finally:
        runner.close()
    assert out.per_function[:, 0].tolist() == [-2.0, 0.0, 2.0]  # one call saw all three
    assert out.errors == {"group_relative": 0, "pid": 0}


def test_per_function_metrics_leave_out_the_completions_a_function_did_not_apply_to():
    # a function that returned None (stored as NaN) for one completion: its mean and population
    # std are over the other three (1, 0, 0.5: mean 0.5, std sqrt(1/6), not the sample std 0.5);
    # a function that applied to none has NaN for both, without torch's warning about the
    # standard deviation of no values on the console
    from grpo.rewards.inputs import per_function_metrics

    nan = math.nan
    per_function = torch.tensor([[1.0, nan], [nan, nan], [0.0, nan], [0.5, nan]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = per_function_metrics(per_function, ["acc", "judge"])
    assert out["reward/acc/mean"] == pytest.approx(0.5)
    assert out["reward/acc/std"] == pytest.approx(math.sqrt(1 / 6))
    assert math.isnan(out["reward/judge/mean"]) and math.isnan(out["reward/judge/std"])
