"""The run directory on its own: manifests, damage, the lock, partial log lines, config changes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from alone import preamble

from grpo.config.diff import config_changes
from grpo.runs import directory
from grpo.runs.directory import (
    Checkpoint,
    RunDir,
    RunDirError,
    complete_final,
    is_disk_full,
    read_jsonl,
    seal,
    verify,
)
from grpo.training.resume import changes_math, math_changes


def _checkpoint(run: RunDir, step: int, payload: bytes = b"weights") -> Path:
    tmp = run.checkpoint_temp(step)
    run.fresh_temp(tmp)
    (tmp / "model.safetensors").write_bytes(payload * 100)
    (tmp / "trainer_state.pt").write_bytes(b"state")
    (tmp / "sub").mkdir()
    (tmp / "sub" / "adapter.bin").write_bytes(b"adapter")
    meta = {"world_size": 1, "run_config": {"optim": {"lr": 0.1}}}
    return run.commit_checkpoint(step, meta, keep_last=5)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "missing": (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
    "truncated": (
        lambda f: os.truncate(f / "model.safetensors", 10),
        "model.safetensors has 10 bytes, its manifest says 700",
    ),
    "flipped": (
        lambda f: _flip_byte(f / "model.safetensors", 350),
        "model.safetensors does not match its checksum",
    ),
    "nested": (lambda f: _flip_byte(f / "sub" / "adapter.bin", 0), "sub/adapter.bin does not"),
    "no-manifest": (lambda f: (f / "manifest.json").unlink(), "no manifest.json"),
    "bad-manifest": (
        lambda f: (f / "manifest.json").write_text('{"files": '),
        "manifest.json is unreadable",
    ),
    # valid JSON of another shape: what one flipped bit in a key, or a hand edit, leaves
    **{
        f"manifest-{name}": (
            lambda f, text=text: (f / "manifest.json").write_text(text),
            "manifest.json is unreadable",
        )
        for name, text in {
            "list": "[1, 2]",
            "null": "null",
            "no-step": '{"files": {}}',
            "bad-entry": '{"step": 2, "files": {"model.safetensors": 700}}',
            "no-config": '{"step": 2, "world_size": 1, "files": {}}',
        }.items()
    },
    "no-state": (
        lambda f: _reseal_without(f, "trainer_state.pt"),
        "a saved model, not a checkpoint (no trainer_state.pt)",
    ),
}


def _reseal_without(folder: Path, name: str) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / name).unlink()
    (folder / "manifest.json").unlink()
    seal(folder, {k: v for k, v in manifest.items() if k != "files"})


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_skipped(tmp_path: Path, capsys, damage: str) -> None:
    run = RunDir(tmp_path / "run")
    run.claim()
    _checkpoint(run, 1)
    newest = _checkpoint(run, 2)
    assert verify(newest) is None
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["files"]["model.safetensors"]["size"] == 700
    hurt, message = DAMAGE[damage]
    hurt(newest)
    assert message in (verify(newest) or Checkpoint.read(newest))
    found = run.latest_checkpoint()
    assert found.step == 1 and found.config == {"optim": {"lr": 0.1}}
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "step-2 is damaged" in err and message in err, err
    # moved aside: never taken again, and the step can be written anew
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-1", "step-2.damaged"]


def test_only_damaged_checkpoints_stop_the_run_instead_of_starting_over(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    (_checkpoint(run, 1) / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(RunDirError, match=r"no complete checkpoint .* train.resume=never"):
        run.latest_checkpoint()


def test_an_unfinished_write_is_not_a_checkpoint(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    _checkpoint(run, 1)
    tmp = run.checkpoint_temp(2)  # killed before its rename: temp name, no manifest
    run.fresh_temp(tmp)
    (tmp / "model.safetensors").write_bytes(b"half")
    assert run.latest_checkpoint().step == 1
    (run.path / ".old-final").mkdir()  # killed while replacing final/
    run.claim()  # a new owner clears what a dead one left half-written
    assert not tmp.exists() and not (run.path / ".old-final").exists()


def test_pruning_keeps_the_newest(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    for step in (1, 2, 3):
        _checkpoint(run, step)
    tmp = run.checkpoint_temp(4)
    run.fresh_temp(tmp)
    (tmp / "a").write_bytes(b"x")
    run.commit_checkpoint(4, {"world_size": 1, "run_config": {}}, keep_last=2)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-3", "step-4"]


def test_final_is_complete_only_when_its_manifest_verifies(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    (run.path / "config.yaml").write_text("{}")
    with pytest.raises(RunDirError, match="final is missing"):
        complete_final(run.path)
    _checkpoint(run, 3)
    with pytest.raises(RunDirError, match=r"newest complete checkpoint is .*step-3"):
        complete_final(run.path)
    run.fresh_temp(run.final_temp())
    (run.final_temp() / "config.json").write_text("{}")
    run.commit_final(3, {})
    assert complete_final(run.path) == run.final and run.final_step() == 3
    (run.final / "config.json").write_text("{} ")
    with pytest.raises(RunDirError, match="final is damaged"):
        complete_final(run.path)


def test_seal_writes_the_manifest_last(tmp_path: Path, monkeypatch) -> None:
    order: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        order.append(os.readlink(f"/proc/self/fd/{fd}").rpartition("/")[2])
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "b.bin").write_bytes(b"b")
    (folder / "a.bin").write_bytes(b"a")
    seal(folder, {"step": 1})
    # every file is on disk before the manifest that vouches for it, the folder last
    assert order == ["a.bin", "b.bin", "manifest.json", "ckpt"]


# --------------------------------------------------------------------------------------- lock

HOLDER = """
import sys, time
from pathlib import Path
from grpo.runs.directory import RunDir
RunDir(Path(sys.argv[1])).claim()
if len(sys.argv) > 2:  # a forked child inherits the process's files, not its record lock
    import os
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
print("locked", flush=True)
time.sleep(60)
"""


def _holder(run: Path, fork_child: bool = False) -> subprocess.Popen:
    # the holder needs run_dir's module alone, not the trainer ``import grpo`` brings
    code = preamble(directory) + HOLDER
    args = [sys.executable, "-c", code, str(run)] + (["fork"] if fork_child else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_process_is_refused_at_once_naming_the_holder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(RunDirError) as caught:  # the lock is tried, never waited for
            RunDir(run).claim()
        message = str(caught.value)
        assert f"in use by pid {holder.pid}" in message and "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    RunDir(run).claim()  # the kernel dropped the dead holder's lock


def test_a_dead_holders_forked_children_do_not_keep_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _holder(run, fork_child=True)
    holder.kill()  # SIGKILL the holder; its forked child (e.g. a reward worker) lives on
    holder.wait()
    try:
        RunDir(run).claim()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunDirError, match=r"train.output_dir: cannot write to .*file/run"):
        RunDir(blocker / "run").claim()


# --------------------------------------------------------------------------------------- logs


def test_resume_drops_a_partial_last_line_and_later_steps(tmp_path: Path, capsys) -> None:
    run = RunDir(tmp_path / "run")
    run.completions.mkdir(parents=True)
    rows = [{"step": s, "loss": 0.5} for s in (1, 2, 3)]
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    for step in (2, 3, 4):
        run.write_completions(step, [{"step": step}])
    run.prepare_logs(2)
    assert [json.loads(ln) for ln in run.metrics.read_text().splitlines()] == rows[:2]
    assert sorted(p.name for p in run.completions.iterdir()) == ["step-000002.jsonl"]
    err = capsys.readouterr().err.strip()
    assert "metrics.jsonl: dropped unreadable line(s) 4" in err and "\n" not in err


# --------------------------------------------------------------------------------------- config


def test_config_changes_name_every_key_and_both_values() -> None:
    old = {"optim": {"lr": 1e-5, "betas": [0.9, 0.99]}, "train": {"steps": 5, "seed": 0}}
    new = {"optim": {"lr": 1e-4, "betas": [0.9, 0.99]}, "train": {"steps": 9, "seed": 1}}
    changes = config_changes(old, new)
    assert changes == {"optim.lr": (1e-5, 1e-4), "train.seed": (0, 1), "train.steps": (5, 9)}
    assert [k for k in changes if changes_math(k)] == ["optim.lr", "train.seed"]
    for free in ("train.save_every", "train.sinks", "train.eval_every", "optim.micro_batch_size"):
        assert not changes_math(free)
    # operational: how generation elsewhere is reached and waited for
    for free in (
        "rollout.producer_timeout_s",
        "rollout.server_url",
        "rollout.server_token",
        "rollout.server_timeout_s",
        "rollout.server_weights_host",
    ):
        assert not changes_math(free)
    for math_key in ("model.name", "data.task", "rollout.group_size", "rewards.functions"):
        assert changes_math(math_key)


def test_a_key_a_newer_version_added_is_no_change_the_user_made() -> None:
    old = {"rewards": {"timeout_s": 10.0}, "optim": {"lr": 0.1}}
    new = {"rewards": {"timeout_s": 10.0, "max_error_frac": 0.5}, "optim": {"lr": 0.2}}
    assert math_changes(old, new) == {"optim.lr": (0.1, 0.2)}
    assert config_changes(old, new)["rewards.max_error_frac"] == (None, 0.5)  # in the history
    # against the defaults: a key the old config lacks had its default then
    defaults = {"rewards": {"timeout_s": 10.0, "max_error_frac": 0.5}, "optim": {"lr": 1.0}}
    assert math_changes(old, new, defaults) == {"optim.lr": (0.1, 0.2)}
    assert "rewards.max_error_frac" not in config_changes(old, new, defaults)
    changed = {**new, "rewards": {**new["rewards"], "max_error_frac": 0.9}}
    assert math_changes(old, changed, defaults)["rewards.max_error_frac"] == (0.5, 0.9)
    # a key removed from a value the new config still has ({} task_args) is a change
    args = {"data": {"task_args": {"max_number": 50}}}
    assert math_changes(args, {"data": {"task_args": {}}}, {"data": {"task_args": {}}}) == {
        "data.task_args.max_number": (50, None)
    }


def test_a_metrics_line_that_is_not_utf8_is_one_more_unreadable_line(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.metrics.write_bytes(b'{"step": 1}\n\xff\xfe garbage\n{"step": 2}\n')
    rows, bad = read_jsonl(run.metrics)
    assert rows == [{"step": 1}, {"step": 2}] and bad == [2]


def test_what_a_previous_run_left_and_what_a_rewind_removes(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.claim()
    assert run.previous_run() == []
    run.log_event(0, "resume")  # event rows alone: no step was trained
    with run.metrics.open("a") as f:
        f.write('{"step": 0, "eval/reward/mean": 0.1}\n')  # the baseline eval before step 1
    assert run.previous_run() == []
    for step in (1, 2, 3):
        _checkpoint(run, step)
    run.fresh_temp(run.final_temp())
    run.commit_final(3, {})
    (run.checkpoints / "step-2").rename(run.checkpoints / "step-2.damaged")
    assert run.previous_run() == ["step-1", "step-2.damaged", "step-3", "final/"]
    assert run.rewind(3) == []  # final/ at step 3 is this step's
    assert run.rewind(1) == ["final/", "step-3"]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-1", "step-2.damaged"]


def test_a_rewind_killed_midway_leaves_a_run_that_resumes(tmp_path: Path, monkeypatch) -> None:
    # killed while removing step-3: step-4, the newest abandoned, is whole (its logs not cut
    # yet), what was half removed is a .old- folder the next owner clears
    run = RunDir(tmp_path / "run")
    run.claim()
    for step in (1, 2, 3, 4):
        _checkpoint(run, step)
    real = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        (Path(path) / "model.safetensors").unlink()  # one file gone, then the kill
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        run.rewind(2)
    monkeypatch.setattr(shutil, "rmtree", real)
    run.claim()
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-1", "step-2", "step-4"]
    assert run.latest_checkpoint().step == 4


def test_disk_full_is_recognised_through_wrappers() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    # what safetensors raises on a full tmpfs (measured)
    assert is_disk_full(
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    )
    try:  # torch.save into a Python file: its error carries the OSError as context
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")  # noqa: B904
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))


def test_a_damaged_checkpoint_goes_once_older_than_every_one_kept(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    for step in (1, 2):
        _checkpoint(run, step)
    (run.checkpoints / "step-2").rename(run.checkpoints / "step-2.damaged")
    (run.checkpoints / "step-x.damaged").mkdir()  # not grpo's: left alone, and no crash

    def commit(step: int) -> list[str]:
        run.fresh_temp(run.checkpoint_temp(step))
        run.commit_checkpoint(step, {"world_size": 1, "run_config": {}}, keep_last=2)
        return sorted(p.name for p in run.checkpoints.iterdir())

    assert commit(3) == ["step-1", "step-2.damaged", "step-3", "step-x.damaged"]
    assert commit(4) == [
        "step-3",
        "step-4",
        "step-x.damaged",
    ]  # where a complete step-2 would have gone too
