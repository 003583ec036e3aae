"""Runs that survive anything: kill -9 at random points, damaged checkpoints, signals, a full disk,
a second run on the same directory, a changed config. Each run that can continue must end with
the weights of an uninterrupted run, bit for bit; the weights move in every one of them (the
trainable reward of tests/toy_rewards.py, which the tiny random model earns with variance)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from grpo.cli import main
from grpo.config import Config, ConfigError, build_config
from grpo.run_dir import RunDirError, verify
from grpo.trainer import Trainer, TrainingStopped, train

STEPS = 4
TRAINABLE_REWARD = f"{Path(__file__).with_name('toy_rewards.py')}:lowercase_share"


@pytest.fixture(scope="module")
def tree(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 4-step run whose weights move at every step (trainable reward, lr 1e-2), as a tree."""
    return {
        "model": {"name": str(tiny_model_dir)},
        "data": {"task": "arithmetic", "task_args": {"size": 32}},
        "rewards": {"functions": [{"name": TRAINABLE_REWARD}]},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "algorithm": {"beta": 0.0},
        "optim": {"lr": 1e-2, "micro_batch_size": 8},
        "train": {
            "steps": STEPS,
            "save_every": 1,
            "keep_last": 2,
            "log_completions": 2,
            "threads": 1,  # the same float sums in every process, so runs compare bit for bit
            "output_dir": str(tmp_path_factory.mktemp("runs")),
            "progress": False,
            "sinks": ["jsonl"],
        },
    }


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make(tree: dict, run_name: str, output_dir: Path | None = None, **train: object) -> Config:
    section = {**tree["train"], "run_name": run_name, **train}
    if output_dir is not None:
        section["output_dir"] = str(output_dir)
    return build_config({**tree, "train": section})


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def step_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without timings and event rows: what must match an uninterrupted run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_s"}
        for row in rows
        if "event" not in row
    ]


@pytest.fixture(scope="module")
def straight(tree: dict, tiny_model_dir: Path) -> Path:
    """The uninterrupted run every interrupted one is compared with."""
    run_dir = train(make(tree, "straight"))
    start, end = weights(tiny_model_dir), weights(run_dir / "final")
    assert max(float((end[k] - start[k]).abs().max()) for k in end) > 1e-2  # training moved them
    return run_dir


def assert_same_run(run_dir: Path, straight: Path) -> None:
    a, b = weights(straight / "final"), weights(run_dir / "final")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert step_rows(run_dir) == step_rows(straight)  # no step lost, none logged twice
    assert [row["step"] for row in step_rows(run_dir)] == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        name = f"completions/step-{step:06d}.jsonl"
        assert (run_dir / name).read_text() == (straight / name).read_text(), name
    assert verify(run_dir / "final") is None


# --------------------------------------------------------------------------------------- kill -9


def test_killed_at_random_points_resumes_bit_identical(tree: dict, tmp_path: Path) -> None:
    # one process imports the trainer once and forks every life (tests/kill_chain.py): the
    # uninterrupted run, then lives each SIGKILLed at a random fsync / rename / torch.save /
    # step phase, each resuming the last, until one reaches the end
    script = Path(__file__).with_name("kill_chain.py")
    chain_tree = {**tree, "train": {**tree["train"], "output_dir": str(tmp_path)}}
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(chain_tree), "0"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lives = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    killed = [life for life in lives[1:] if life["killed"]]
    assert lives[-1]["exit"] == 0 and all(life["killed"] or life["exit"] == 0 for life in lives)
    assert len(killed) >= 5, lives
    straight, chain = tmp_path / "straight", tmp_path / "chain"
    start = weights(Path(tree["model"]["name"]))
    moved = weights(straight / "final")
    assert max(float((moved[k] - start[k]).abs().max()) for k in moved) > 1e-2
    assert_same_run(chain, straight)
    deaths = (tmp_path / "kills.log").read_text()
    print(f"{len(killed)} kills at: {deaths}")


# --------------------------------------------------------------------------------------- damage


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "missing-weights": lambda f: (f / "model.safetensors").unlink(),
    "truncated-state": lambda f: os.truncate(f / "trainer_state.pt", 1000),
    "flipped-weight-bit": lambda f: _flip_last_byte(f / "model.safetensors"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(
    tree: dict, straight: Path, capsys, damage: str
) -> None:
    run_dir = train(make(tree, damage, steps=3))
    DAMAGE[damage](run_dir / "checkpoints" / "step-3")
    capsys.readouterr()
    train(make(tree, damage))  # the same command, more steps
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if "damaged" in line]
    assert len(warning) == 1 and "step-3 is damaged" in warning[0], captured.err
    assert "resuming from" in captured.out and "step-2 (step 2)" in captured.out
    resume = [row for row in map(json.loads, (run_dir / "metrics.jsonl").open()) if "event" in row]
    assert resume == [{"step": 2, "event": "resume", "checkpoint": "checkpoints/step-2"}]
    assert_same_run(run_dir, straight)


# --------------------------------------------------------------------------------------- signals


def _signal_during_step(monkeypatch, at_step: int, signals: list[signal.Signals]) -> None:
    original = Trainer.train_step

    def step(self: Trainer) -> dict:
        metrics = original(self)
        if self.step == at_step:
            for signum in signals:
                os.kill(os.getpid(), signum)
        return metrics

    monkeypatch.setattr(Trainer, "train_step", step)


def test_sigterm_finishes_the_step_and_writes_a_checkpoint(
    tree: dict, straight: Path, monkeypatch, capsys
) -> None:
    config = make(tree, "sigterm", save_every=0)  # only the stop writes a checkpoint
    _signal_during_step(monkeypatch, 2, [signal.SIGTERM])
    with pytest.raises(TrainingStopped) as stopped:
        train(config)
    assert stopped.value.exit_code == 143 and stopped.value.step == 2
    assert str(stopped.value.checkpoint).endswith("checkpoints/step-2")
    assert "SIGTERM: stopping after this step" in capsys.readouterr().err
    run_dir = config.run_dir
    assert verify(run_dir / "checkpoints" / "step-2") is None and not (run_dir / "final").exists()
    # a kill during a later write left half a line: dropped with a warning on resume
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')
    monkeypatch.undo()
    train(config)
    assert "dropped unreadable line(s) 3" in capsys.readouterr().err
    assert_same_run(run_dir, straight)


def test_a_second_sigint_stops_at_once(tree: dict, straight: Path, monkeypatch) -> None:
    config = make(tree, "sigint")
    # what the test process had (a shell's background job starts with SIGINT ignored)
    before = signal.getsignal(signal.SIGINT)
    _signal_during_step(monkeypatch, 3, [signal.SIGINT, signal.SIGINT])
    with pytest.raises(TrainingStopped) as stopped:
        train(config)
    # stopped inside step 3 before its checkpoint: step 2's is the newest complete one
    assert stopped.value.exit_code == 130 and "at once" in str(stopped.value)
    assert str(stopped.value.checkpoint).endswith("checkpoints/step-2")
    assert signal.getsignal(signal.SIGINT) == before  # handlers restored
    monkeypatch.undo()
    train(config)
    assert_same_run(config.run_dir, straight)


def test_cli_stop_and_a_second_run_on_the_same_directory(
    tree: dict, straight: Path, tmp_path: Path, capsys
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(make(tree, "cli").model_dump(mode="json")))
    run_dir = Path(tree["train"]["output_dir"]) / "cli"
    grpo = Path(sys.executable).parent / "grpo"
    proc = subprocess.Popen(
        [str(grpo), "train", str(recipe)], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGSTOP)  # frozen in its first steps, holding the directory
        # a second run on the same directory stops before its model loads, naming the first
        assert main(["train", str(recipe)]) == 2
        err = capsys.readouterr().err.strip()
        assert f"in use by pid {proc.pid}" in err and "\n" not in err, err
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert f"resume with: grpo train {recipe}" in last and "stopped by SIGTERM after step" in last
    assert main(["train", str(recipe)]) == 0
    assert_same_run(run_dir, straight)


def _torchrun(recipe: Path, **popen: object) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*cmd, "-m", "grpo.cli", "train", str(recipe)], env=env, text=True, **popen
    )


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_every_rank_after_the_same_step(
    tree: dict, tmp_path: Path
) -> None:
    # torchrun forwards SIGTERM to both ranks; they agree on the step, rank 0 seals the
    # checkpoint with rank 1's RNG state in it, and the resumed run is the uninterrupted one
    straight, stopped = tmp_path / "straight.yaml", tmp_path / "stopped.yaml"
    for recipe, name in ((straight, "ranks-straight"), (stopped, "ranks-stopped")):
        config = make(tree, name, output_dir=tmp_path / "runs", save_every=0)
        recipe.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert _torchrun(straight).wait(timeout=600) == 0
    run_dir = tmp_path / "runs" / "ranks-stopped"
    proc = _torchrun(stopped, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.05)
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").read_text():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the torchrun agent, as a scheduler would
    _, stderr = proc.communicate(timeout=300)
    stops = [line for line in stderr.splitlines() if line.startswith("grpo: stopped by SIGTERM")]
    assert len(stops) == 1 and "resume with: the same torchrun command" in stops[0], stderr
    step = int(stops[0].split("after step ")[1].split(":")[0])
    assert 1 <= step < STEPS
    checkpoint = run_dir / "checkpoints" / f"step-{step}"
    assert verify(checkpoint) is None and (checkpoint / "rng-rank1.pt").is_file()
    assert [row["step"] for row in step_rows(run_dir)] == list(range(1, step + 1))
    assert _torchrun(stopped).wait(timeout=600) == 0
    a = weights(tmp_path / "runs" / "ranks-straight" / "final")
    b = weights(run_dir / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------- disk


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def _fill(folder: Path) -> Path:
    """Take every free byte of the file system under ``folder``."""
    filler = folder / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_is_one_line_naming_the_intact_checkpoint(
    tree: dict, straight: Path, tmp_path: Path, monkeypatch
) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "8m"):
        pytest.skip("cannot mount a tmpfs here (needs root): see the simulated test below")
    try:
        config = make(tree, "full", output_dir=disk)
        original = Trainer.train_step
        filler: list[Path] = []

        def step(self: Trainer) -> dict:
            if self.step == 3 and not filler:  # after step 2's checkpoint
                filler.append(_fill(disk))
            return original(self)

        monkeypatch.setattr(Trainer, "train_step", step)
        with pytest.raises(RunDirError) as full:
            train(config)
        message = str(full.value)
        assert message.startswith("disk full while writing") and "\n" not in message
        assert f"{config.run_dir}/checkpoints/step-2 is intact" in message
        assert verify(config.run_dir / "checkpoints" / "step-2") is None
        assert not list((config.run_dir / "checkpoints").glob(".tmp-*"))  # its space given back
        monkeypatch.undo()
        filler[0].unlink()
        train(config)
        assert_same_run(config.run_dir, straight)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_while_saving_is_one_line_simulated(
    tree: dict, straight: Path, monkeypatch
) -> None:
    import errno

    import grpo.trainer

    config = make(tree, "full-simulated")
    original = grpo.trainer.save_torch

    def save(obj: object, path: Path) -> None:
        if "step-3" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        original(obj, path)

    monkeypatch.setattr(grpo.trainer, "save_torch", save)
    with pytest.raises(RunDirError, match=r"disk full .*/checkpoints/step-2 is intact"):
        train(config)
    monkeypatch.undo()
    train(config)
    assert_same_run(config.run_dir, straight)


# --------------------------------------------------------------------------------------- config


def test_a_resume_that_changes_the_math_is_refused_or_forced(tree: dict) -> None:
    train(make(tree, "changed", steps=2))
    changed = {**tree, "optim": {**tree["optim"], "lr": 5e-3}, "rollout": {**tree["rollout"]}}
    changed["rollout"]["group_size"] = 2
    with pytest.raises(ConfigError) as refused:
        Trainer(make(changed, "changed", steps=3))
    message = str(refused.value)
    assert "optim.lr 0.01 -> 0.005" in message and "rollout.group_size 4 -> 2" in message
    assert "train.resume=force" in message and "\n" not in message
    # steps, logging and save cadence change freely: extending a finished run keeps working
    run_dir = train(make(tree, "changed", steps=3, log_completions=1, save_every=2))
    assert [row["step"] for row in step_rows(run_dir)] == [1, 2, 3]
    # forced: recorded in the history, and really applied (the restored optimizer took the new lr)
    forced = Trainer(make(changed, "changed", steps=4, resume="force"))
    forced.train()
    rows = step_rows(run_dir)
    assert [row["lr"] for row in rows] == [1e-2, 1e-2, 1e-2, 5e-3]
    assert forced.optimizer.param_groups[0]["lr"] == 5e-3
    assert forced.scheduler.base_lrs == [5e-3]
    history = [json.loads(line) for line in (run_dir / "config_history.jsonl").open()]
    assert [h["event"] for h in history] == ["start", "resume", "resume"]
    assert history[-1]["step"] == 3
    assert history[-1]["changed"]["optim.lr"] == [1e-2, 5e-3]
    assert history[-1]["changed"]["rollout.group_size"] == [4, 2]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"] == 5e-3


def test_the_engine_gets_the_restored_weights(tree: dict, monkeypatch) -> None:
    train(make(tree, "sync", steps=1))
    pushed: list[dict[str, torch.Tensor]] = []
    trainer = Trainer(make(tree, "sync", steps=2))
    monkeypatch.setattr(
        trainer.engine,
        "sync_weights",
        lambda model: pushed.append({k: v.clone() for k, v in model.state_dict().items()}),
    )
    trainer.load_checkpoint(trainer.resume_from.path)
    saved = weights(trainer.resume_from.path)
    assert len(pushed) == 1
    assert all(torch.equal(pushed[0][k], saved[k]) for k in saved)
