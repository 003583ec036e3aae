"""Runs that survive anything: kill -9 at random points, damaged checkpoints, signals, a full disk,
a second run on the same directory, a changed config. Each run that can continue must end with
the weights of an uninterrupted run, bit for bit; the weights move in every one of them (the
trainable reward of tests/toy_rewards.py, which the tiny random model earns with variance)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from run_logs import kill_chain, step_rows
from safetensors.torch import load_file

from grpo.cli import main
from grpo.config import Config, ConfigError, build_config
from grpo.models import build_tiny_model
from grpo.runs.directory import RunDirError, verify
from grpo.training.signals import TrainingStopped
from grpo.training.trainer import Trainer, train

STEPS = 4
TRAINABLE_REWARD = f"{Path(__file__).parents[1] / 'toy_rewards.py'}:lowercase_share"


@pytest.fixture(scope="module")
def tree(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 4-step run whose weights move at every step (trainable reward, lr 1e-2), as a tree."""
    return {
        "model": {"name": str(tiny_model_dir), "precision": "float32"},
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
    # one process imports the trainer once and forks every life (tests/integration/kill_chain.py): the
    # uninterrupted run, then lives each SIGKILLed at a random fsync / rename / torch.save /
    # step phase, each resuming the last, until one reaches the end
    lives = kill_chain(tree, tmp_path, seed=0, timeout=900)
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
        if self.state.step == at_step:
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
            if self.state.step == 3 and not filler:  # after step 2's checkpoint
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

    import grpo.training.checkpoint

    config = make(tree, "full-simulated")
    original = grpo.training.checkpoint.save_torch

    def save(obj: object, path: Path) -> None:
        if "step-3" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        original(obj, path)

    monkeypatch.setattr(grpo.training.checkpoint, "save_torch", save)
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
    assert forced.state.optimizer.param_groups[0]["lr"] == 5e-3
    assert forced.state.scheduler.base_lrs == [5e-3]
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
        trainer.producer.engine,
        "sync_weights",
        lambda model: pushed.append({k: v.clone() for k, v in model.state_dict().items()}),
    )
    trainer.resume_from(trainer.plan.checkpoint.path)
    saved = weights(trainer.plan.checkpoint.path)
    assert trainer.state.step == trainer.saved_step == 1
    assert trainer.run.intact == trainer.plan.checkpoint.path
    assert len(pushed) == 1
    assert all(torch.equal(pushed[0][k], saved[k]) for k in saved)


# --------------------------------------------------------------------------------- what is kept


def test_a_run_with_no_checkpoint_to_resume_is_never_started_over_unasked(tree: dict) -> None:
    # every checkpoint damaged: refused, and refused again on the next try (the damaged ones
    # moved aside are no reason to start over); train.resume=never starts over
    run_dir = train(make(tree, "unasked", steps=2))
    for step in (1, 2):
        os.truncate(run_dir / "checkpoints" / f"step-{step}" / "model.safetensors", 10)
    for _ in range(2):
        with pytest.raises(RunDirError) as refused:
            Trainer(make(tree, "unasked", steps=3))
        assert "train.resume=never" in str(refused.value) and "\n" not in str(refused.value)
    assert "step-2.damaged" in str(refused.value) and "final/" in str(refused.value)
    # checkpoints deleted to save space, final/ kept: a longer run is not a silent restart
    for folder in (run_dir / "checkpoints").iterdir():
        shutil.rmtree(folder)
    with pytest.raises(RunDirError, match=r"holds a run \(final/, metrics.jsonl\) with no"):
        Trainer(make(tree, "unasked", steps=3))
    with pytest.raises(ConfigError, match=r"train.resume=force: no checkpoint"):
        Trainer(make(tree, "fresh-forced", resume="force"))
    train(make(tree, "unasked", steps=1, resume="never"))
    assert [row["step"] for row in step_rows(run_dir)] == [1]


def test_a_rewind_removes_what_followed_its_checkpoint(tree: dict, straight: Path, capsys) -> None:
    run_dir = train(make(tree, "rewind", keep_last=3))  # step-2, step-3, step-4 and final/
    capsys.readouterr()
    train(make(tree, "rewind", keep_last=1, resume=str(run_dir / "checkpoints" / "step-2")))
    out = capsys.readouterr().out
    assert "removed what followed step 2: final/, step-3, step-4" in out, out
    # the rewound run's final/ and newest checkpoint, not the abandoned ones
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-4"]
    assert_same_run(run_dir, straight)
    # another run's checkpoint resumes into a new run directory only
    train(make(tree, "own-run", steps=1))
    other = str(run_dir / "checkpoints" / "step-4")
    with pytest.raises(RunDirError, match=r"another run's checkpoint .* another train.run_name"):
        Trainer(make(tree, "own-run", resume=other))


def test_what_no_resume_can_change_is_refused_in_one_line(tree: dict, tmp_path: Path) -> None:
    run_dir = train(make(tree, "fixed", steps=2))
    lora = {**tree, "model": {**tree["model"], "lora": {"enabled": True}}}
    other = build_tiny_model(tmp_path / "other", seed=1)  # the same shapes, other weights
    renamed = {**tree, "model": {**tree["model"], "name": str(other)}}
    for changed, key in ((lora, "model.lora.enabled"), (renamed, "model.name")):
        with pytest.raises(ConfigError) as refused:
            Trainer(make(changed, "fixed", steps=3, resume="force"))
        message = str(refused.value)
        assert key in message and "not even with train.resume=force" in message
        assert "\n" not in message
    with pytest.raises(ConfigError, match=r"train.steps 1 is below the step of .*step-2 \(2\)"):
        Trainer(make(tree, "fixed", steps=1))
    with pytest.raises(RunDirError, match="a saved model, not a checkpoint"):
        Trainer(make(tree, "fixed", steps=3, resume=str(run_dir / "final")))
    # what changes nothing goes on: the same files in another folder, LoRA's rank with LoRA off
    moved = tmp_path / "moved"
    shutil.copytree(tree["model"]["name"], moved)
    same = {**tree, "model": {**tree["model"], "name": str(moved), "lora": {"r": 4}}}
    assert Trainer(make(same, "fixed", steps=3)).plan.step == 2


def test_a_model_folder_changed_under_its_name_is_one_line(tree: dict, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tree["model"]["name"], folder)
    moved = {**tree, "model": {**tree["model"], "name": str(folder)}}
    train(make(moved, "swapped", steps=1))
    shutil.rmtree(folder)
    build_tiny_model(folder, hidden_size=32)
    with pytest.raises(ConfigError, match="the model folder's files"):
        Trainer(make(moved, "swapped", steps=2))
    with pytest.raises(RunDirError) as refused:  # forced: the weights cannot fit
        train(make(moved, "swapped", steps=2, resume="force"))
    message = str(refused.value)
    assert "does not fit the model" in message and "size mismatch" in message
    assert "\n" not in message


def test_the_changes_a_resume_makes_are_said_on_the_console(tree: dict, capsys) -> None:
    train(make(tree, "said", steps=1))
    capsys.readouterr()
    changed = {**tree, "optim": {**tree["optim"], "micro_batch_size": 4}}
    train(make(changed, "said", steps=2, keep_last=1))
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("grpo: from step 1")]
    assert len(said) == 1, out
    for change in ("optim.micro_batch_size 8 -> 4", "train.keep_last 2 -> 1", "train.steps 1 -> 2"):
        assert change in said[0]


def test_the_resume_command_after_a_stop_continues_the_run(monkeypatch, capsys) -> None:
    # the command as given would start over ("never") or rewind again (a path)
    def stopped(config):
        raise TrainingStopped(signal.SIGTERM, 3, Path("runs/x/checkpoints/step-3"), False)

    monkeypatch.setattr("grpo.training.trainer.train", stopped)
    for given in ("train.resume=never", "train.resume=runs/x/checkpoints/step-1"):
        argv = ["grpo", "train", "train.run_name=x", given]
        monkeypatch.setattr(sys, "argv", argv)
        assert main(argv[1:]) == 143
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.endswith("resume with: grpo train train.run_name=x train.resume=auto"), last

    def stopped_before_a_checkpoint(config):
        raise TrainingStopped(signal.SIGINT, 1, None, True)

    monkeypatch.setattr("grpo.training.trainer.train", stopped_before_a_checkpoint)
    assert main(argv[1:]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("start over with: grpo train train.run_name=x train.resume=never"), last


def test_a_rewind_then_a_forced_change_as_the_refusal_says(tree: dict) -> None:
    run_dir = train(make(tree, "rewind-lr", steps=3, keep_last=3))
    slower = {**tree, "optim": {**tree["optim"], "lr": 5e-3}}
    step_1 = str(run_dir / "checkpoints" / "step-1")
    with pytest.raises(ConfigError, match=r"rewind to it first \(train.steps=1 and its config\)"):
        Trainer(make(slower, "rewind-lr", steps=3, resume=step_1))
    train(make(tree, "rewind-lr", steps=1, resume=step_1))
    train(make(slower, "rewind-lr", steps=3, resume="force"))
    assert [row["lr"] for row in step_rows(run_dir)] == [1e-2, 5e-3, 5e-3]


def test_inputs_changed_under_the_same_names_are_a_change_of_the_math(
    tree: dict, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(8))
    )
    model = tmp_path / "model"
    shutil.copytree(tree["model"]["name"], model)
    moved = {**tree, "model": {**tree["model"], "name": str(model)}, "data": {"path": str(data)}}
    train(make(moved, "inputs", steps=1))
    data.write_text(data.read_text().replace("say 3", "say three"))
    with pytest.raises(ConfigError, match=r"changes the math: the data's rows '[0-9a-f]+' -> "):
        Trainer(make(moved, "inputs", steps=2))
    shutil.rmtree(model)
    build_tiny_model(model, seed=1)  # another model of the same shapes under the same name
    with pytest.raises(ConfigError, match=r"the data's rows .*, the model folder's files '"):
        Trainer(make(moved, "inputs", steps=2))
    run_dir = train(make(moved, "inputs", steps=2, resume="force"))
    history = [json.loads(line) for line in (run_dir / "config_history.jsonl").open()]
    assert {"the data's rows", "the model folder's files"} <= history[-1]["changed"].keys()
