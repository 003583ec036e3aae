"""The resume decision on its own (``plan_resume``, ``open_run``): run directories with sealed
checkpoints whose manifests hold a config, and no model or trainer."""

from __future__ import annotations

import json
import linecache
import sys
from pathlib import Path

import pytest

from grpo.build import Given, environment_of
from grpo.config import Config, ConfigError, build_config, dump_config
from grpo.runs.directory import RunDir, RunDirError, model_digest, rows_digest
from grpo.training.resume import (
    ResumePlan,
    fingerprints,
    input_changes,
    moot_change,
    open_run,
    plan_resume,
)

INPUTS = {"data": "d0", "model": "m0"}


def _config(**sections: dict) -> Config:
    tree: dict = {
        "model": {"name": "base"},
        "optim": {"lr": 1e-5, "micro_batch_size": 4},
        "train": {"steps": 10},
    }
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value}
    return build_config(tree)


def _save(run: RunDir, step: int, config: Config, world_size: int = 1, inputs=INPUTS) -> Path:
    """A sealed checkpoint of ``step`` trained with ``config`` (its files' contents never matter
    to the decision)."""
    tmp = run.checkpoint_temp(step)
    run.fresh_temp(tmp)
    (tmp / "trainer_state.pt").write_bytes(b"state")
    meta = {"world_size": world_size, "run_config": config.model_dump(mode="json")}
    return run.commit_checkpoint(step, {**meta, "inputs": inputs}, keep_last=5)


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    """A run directory holding checkpoints of steps 2 and 3, both of ``_config()``."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    for step in (2, 3):
        _save(run, step, _config())
    return run


def test_a_new_run_directory_starts_fresh(tmp_path: Path) -> None:
    plan = plan_resume(RunDir(tmp_path / "new"), _config(), 1, INPUTS)
    assert plan == ResumePlan() and plan.step == 0 and plan.checkpoint is None


def test_the_newest_checkpoint_resumes_with_no_change(run: RunDir) -> None:
    plan = plan_resume(run, _config(), 1, INPUTS)
    assert plan.step == 3 and plan.checkpoint.path == run.checkpoints / "step-3"
    assert plan.changes == {} and plan.forced == {}


def test_resume_never_starts_fresh_over_checkpoints(run: RunDir) -> None:
    assert plan_resume(run, _config(train={"resume": "never"}), 1, INPUTS) == ResumePlan()


def test_a_chosen_checkpoint_resumes_at_its_step(run: RunDir) -> None:
    chosen = str(run.checkpoints / "step-2")
    plan = plan_resume(run, _config(train={"resume": chosen}), 1, INPUTS)
    assert plan.step == 2 and plan.checkpoint.path == Path(chosen)


def test_a_math_change_is_refused_with_the_line_to_print(run: RunDir) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_resume(run, _config(optim={"lr": 2e-5}), 1, INPUTS)
    assert str(refused.value) == (
        f"resuming {run.checkpoints / 'step-3'} with a config that changes the math: "
        "optim.lr 1e-05 -> 2e-05; set train.resume=force to apply the change, or "
        "train.resume=never to start over"
    )


def test_a_chosen_checkpoint_with_a_math_change_says_to_rewind_first(run: RunDir) -> None:
    step_2 = run.checkpoints / "step-2"
    config = _config(optim={"lr": 2e-5}, train={"resume": str(step_2)})
    with pytest.raises(ConfigError) as refused:
        plan_resume(run, config, 1, INPUTS)
    assert str(refused.value).endswith(
        "optim.lr 1e-05 -> 2e-05; a chosen checkpoint resumes with its own config: rewind to it "
        "first (train.steps=2 and its config), then apply the change with train.resume=force"
    )


def test_force_applies_a_math_change_and_names_it(run: RunDir) -> None:
    plan = plan_resume(run, _config(optim={"lr": 2e-5}, train={"resume": "force"}), 1, INPUTS)
    assert plan.step == 3
    assert plan.forced == {"optim.lr": (1e-5, 2e-5)}
    # the history holds the resume's every change; train.resume itself is one
    assert plan.changes == {"optim.lr": (1e-5, 2e-5), "train.resume": ("auto", "force")}


def test_a_fixed_key_is_refused_even_when_forced(run: RunDir) -> None:
    # another model folder (its files differ too: another fingerprint) cannot take the weights
    config = _config(model={"name": "other-model"}, train={"resume": "force"})
    with pytest.raises(ConfigError) as refused:
        plan_resume(run, config, 1, {**INPUTS, "model": "m1"})
    step_3 = run.checkpoints / "step-3"
    assert str(refused.value) == (
        f"resuming {step_3}: model.name 'base' -> 'other-model' cannot change "
        "on resume (the checkpoint's weights would not fit), not even with train.resume=force; "
        f"start a new run (train.run_name) with model.name={step_3}"
    )
    lora = _config(model={"lora": {"enabled": True}}, train={"resume": "force"})
    with pytest.raises(ConfigError, match=r"model\.lora\.enabled False -> True cannot change"):
        plan_resume(run, lora, 1, INPUTS)


def test_a_free_key_change_is_allowed_and_described(run: RunDir, capsys) -> None:
    config = _config(optim={"micro_batch_size": 8}, train={"save_every": 1})
    plan = plan_resume(run, config, 1, INPUTS)
    assert plan.step == 3 and plan.forced == {}
    assert plan.changes == {"optim.micro_batch_size": (4, 8), "train.save_every": (0, 1)}
    open_run(run, plan, "optim: {}\n")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"grpo: resuming from {run.checkpoints / 'step-3'} (step 3)",
        "grpo: from step 3 optim.micro_batch_size 4 -> 8, train.save_every 0 -> 1",
    ]
    # the history records the step, the event and both changes
    (record,) = [json.loads(line) for line in run.history.read_text().splitlines()]
    assert record["step"] == 3 and record["event"] == "resume"
    assert record["changed"] == {
        "optim.micro_batch_size": [4, 8],
        "train.save_every": [0, 1],
    }


def test_a_restarted_server_or_a_longer_wait_resumes_without_force(run: RunDir) -> None:
    # the run stopped because its producer or server was lost: the same command with another
    # server address and longer timeouts resumes (they change how generation is reached, not
    # what is computed)
    rollout = {"server_url": "http://127.0.0.1:9001", "producer_timeout_s": 1800.0}
    plan = plan_resume(run, _config(rollout={**rollout, "server_timeout_s": 60.0}), 1, INPUTS)
    assert plan.step == 3 and plan.forced == {}
    assert set(plan.changes) == {
        "rollout.server_url",
        "rollout.producer_timeout_s",
        "rollout.server_timeout_s",
    }


def test_a_changed_input_fingerprint_is_refused(run: RunDir) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_resume(run, _config(), 1, {**INPUTS, "data": "d1"})
    assert "changes the math: the data's rows 'd0' -> 'd1'; set train.resume=force" in str(
        refused.value
    )
    forced = plan_resume(run, _config(train={"resume": "force"}), 1, {**INPUTS, "data": "d1"})
    assert forced.forced == {"the data's rows": ("d0", "d1")}


def test_a_fingerprint_one_side_lacks_is_no_change() -> None:
    assert input_changes({"data": "d0"}, {"data": "d0", "model": "m1"}) == {}
    assert input_changes({}, INPUTS) == {}  # a checkpoint older than fingerprints
    assert input_changes(INPUTS, {"data": None, "model": "m1"}) == {
        "the model folder's files": ("m0", "m1")
    }


def test_a_moved_model_folder_with_the_same_files_resumes(run: RunDir) -> None:
    # model.name changed, but the files' fingerprint is the checkpoint's: no change of the math
    plan = plan_resume(run, _config(model={"name": "/elsewhere/model"}), 1, INPUTS)
    assert plan.step == 3 and plan.forced == {}
    assert plan.changes == {"model.name": ("base", "/elsewhere/model")}


def test_changes_that_change_nothing() -> None:
    off = _config().model_dump(mode="json")
    on = _config(model={"lora": {"enabled": True}}).model_dump(mode="json")
    assert moot_change("model.name", ("a", "b"), off, same_model=True)
    assert not moot_change("model.name", ("a", "b"), off, same_model=False)
    assert moot_change("model.lora.r", (16, 8), off, same_model=False)  # LoRA is off
    assert not moot_change("model.lora.r", (16, 8), on, same_model=False)
    targets = (["q_proj", "v_proj"], ["v_proj", "q_proj"])
    assert moot_change("model.lora.target_modules", targets, on, same_model=False)
    assert not moot_change("model.lora.enabled", (False, True), on, same_model=False)
    assert not moot_change("optim.lr", (1e-5, 2e-5), on, same_model=True)


def test_another_world_size_is_refused(run: RunDir) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_resume(run, _config(), 2, INPUTS)
    assert str(refused.value) == (
        f"checkpoint {run.checkpoints / 'step-3'} was written by 1 process(es); resume it with "
        "the same number (this run has 2)"
    )


def test_steps_below_the_checkpoints_step_are_refused(run: RunDir) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_resume(run, _config(train={"steps": 2}), 1, INPUTS)
    assert str(refused.value) == (
        f"train.steps 2 is below the step of {run.checkpoints / 'step-3'} (3); raise it to train on"
    )


def test_a_run_without_a_checkpoint_is_never_started_over_unasked(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.metrics.write_text('{"step": 1, "loss": 0.5}\n')
    with pytest.raises(RunDirError) as refused:
        plan_resume(run, _config(), 1, INPUTS)
    assert str(refused.value) == (
        f"{run.path} holds a run (metrics.jsonl) with no checkpoint to resume; set "
        "train.resume=never to start over, or another train.run_name"
    )
    run.metrics.unlink()
    with pytest.raises(ConfigError) as refused:
        plan_resume(run, _config(train={"resume": "force"}), 1, INPUTS)
    assert str(refused.value) == f"train.resume=force: no checkpoint in {run.checkpoints}"


def test_a_run_stopped_before_its_first_checkpoint_starts_over_with_the_same_config(
    tmp_path: Path, capsys
) -> None:
    # killed after step 1, before a checkpoint: the same command starts over and says so;
    # another config (one that changes the math) is still refused
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.metrics.write_text('{"step": 1, "loss": 0.5}\n')
    (run.path / "config.yaml").write_text(dump_config(_config()))
    assert plan_resume(run, _config(), 1, INPUTS).checkpoint is None
    assert capsys.readouterr().out == (
        f"grpo: {run.path} holds the steps of a run of this config stopped before its first "
        "checkpoint: starting over (the same seed computes them again)\n"
    )
    with pytest.raises(RunDirError, match=r"holds a run \(metrics.jsonl\) with no checkpoint"):
        plan_resume(run, _config(optim={"lr": 1e-4}), 1, INPUTS)
    (run.path / "config.yaml").write_text("- not a config\n")
    with pytest.raises(RunDirError, match=r"holds a run \(metrics.jsonl\) with no checkpoint"):
        plan_resume(run, _config(), 1, INPUTS)


def test_another_runs_checkpoint_does_not_resume_into_a_run_of_its_own(
    run: RunDir, tmp_path: Path
) -> None:
    other = RunDir(tmp_path / "other")
    other.path.mkdir()
    elsewhere = _save(other, 5, _config())
    config = _config(train={"resume": str(elsewhere)})
    with pytest.raises(RunDirError, match=r"is another run's checkpoint and .* holds a run"):
        plan_resume(run, config, 1, INPUTS)
    # into a new run directory it resumes
    plan = plan_resume(RunDir(tmp_path / "new"), config, 1, INPUTS)
    assert plan.step == 5 and plan.checkpoint.path == elsewhere


def test_opening_a_run_says_what_it_removes_and_forces(run: RunDir, capsys) -> None:
    step_2, step_3 = run.checkpoints / "step-2", run.checkpoints / "step-3"
    # a chosen older checkpoint: what followed it goes, by name
    open_run(run, plan_resume(run, _config(train={"resume": str(step_2)}), 1, INPUTS), "")
    assert not step_3.exists() and step_2.is_dir()
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"grpo: resuming from {step_2} (step 2)",
        "grpo: removed what followed step 2: step-3",
    ]
    # a forced change is said apart from the free ones
    config = _config(optim={"lr": 2e-5, "micro_batch_size": 8}, train={"resume": "force"})
    open_run(run, plan_resume(run, config, 1, INPUTS), "")
    assert capsys.readouterr().out.splitlines()[1:] == [
        "grpo: train.resume=force: from step 2 optim.lr 1e-05 -> 2e-05",
        "grpo: from step 2 optim.micro_batch_size 4 -> 8, train.resume 'auto' -> 'force'",
    ]


def test_a_fresh_start_replaces_what_a_previous_run_left(run: RunDir, capsys) -> None:
    run.metrics.write_text('{"step": 1}\n')
    open_run(run, plan_resume(run, _config(train={"resume": "never"}), 1, INPUTS), "a: 1\n")
    assert not run.checkpoints.exists() and not run.metrics.exists()
    assert capsys.readouterr().out == ""
    assert (run.path / "config.yaml").read_text() == "a: 1\n"
    (record,) = [json.loads(line) for line in run.history.read_text().splitlines()]
    assert (record["step"], record["event"], record["changed"]) == (0, "start", {})


def test_fingerprints_cover_a_data_file_and_a_model_folder(tmp_path: Path) -> None:
    rows = [{"prompt": "1 + 1?", "answer": "2"}]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    task = fingerprints(_config(), rows, str(model), Given())
    # a task's rows follow from the config (compared anyway); nothing was given
    digest = model_digest(str(model))
    assert task == {
        "data": None,
        "model": digest,
        "given_model": None,
        "environment": None,
        "environment_file": None,
        "rewards": None,
        "tokenizer": None,
    }
    from_file = fingerprints(_config(data={"path": "rows.jsonl"}), rows, "hub/id", Given())
    assert from_file["data"] == rows_digest(rows) and from_file["model"] is None  # a hub id
    # the same names over other contents: other fingerprints
    (model / "model.safetensors").write_bytes(b"other weights")
    assert fingerprints(_config(), rows, str(model), Given())["model"] != task["model"]
    edited = fingerprints(
        _config(data={"path": "rows.jsonl"}), [{"prompt": "2?"}], "hub/id", Given()
    )
    assert edited["data"] != from_file["data"]


def test_fingerprints_cover_an_environment_class_by_its_source(tmp_path: Path) -> None:
    # the same path and class name over an edited file: a resume would play another game
    game = tmp_path / "game.py"

    def prints(reward: int, high: int) -> dict:
        game.write_text(
            f"HIGH = {high}  # outside the class, read by it\n"
            "class Game:\n"
            "    def reset(self, **row):\n"
            "        return None\n"
            "    def guess(self, n: int) -> str:\n"
            '        """Guess.\n\n        Args:\n            n: a number\n        """\n'
            "        return 'no'\n"
            "    def get_reward(self):\n"
            f"        return {reward}\n"
        )
        sys.modules.pop("game", None)
        linecache.clearcache()  # inspect reads sources through it
        environment = environment_of(_config(rollout={"environment": f"{game}:Game"}))
        return fingerprints(_config(), [], None, Given(), environment)

    def file_print(reward: int, high: int = 3) -> str:
        return prints(reward, high)["environment_file"]

    def fingerprint(reward: int, high: int = 3) -> str:
        return prints(reward, high)["environment"]

    first = fingerprint(1)
    assert first is not None and fingerprint(1) == first
    assert fingerprint(2) != first
    assert input_changes({"environment": first}, {"environment": fingerprint(2)}) == {
        "the environment class's source": (first, fingerprint(2))
    }
    # the file's constant changed, not the class: the file's own fingerprint says so, and a
    # checkpoint written before it had one (no such key) resumes as before
    assert fingerprint(1, high=100) == first
    assert file_print(1) != file_print(1, high=100)
    assert input_changes({"environment": first}, {"environment_file": file_print(1)}) == {}
