"""A checkpoint's contents on their own: what ``save_checkpoint`` writes of a training state
and ``load_checkpoint`` restores, without a trainer."""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo import step_data
from grpo.config import build_config
from grpo.models import load_policy, load_tokenizer
from grpo.runs.directory import Checkpoint, RunDir, RunDirError
from grpo.runtime.distributed import DistInfo
from grpo.scoring import distribution
from grpo.training import producer_process
from grpo.training.checkpoint import (
    WrittenWith,
    load_checkpoint,
    load_torch,
    save_checkpoint,
    save_torch,
)
from grpo.training.entropy_bonus import EntropyBonus
from grpo.training.hack_watch import HackWatch
from grpo.training.optimizer import build_optimizer
from grpo.training.producer import InProcessProducer, ProducedStep
from grpo.training.state import TrainingState, capture_rng, restore_rng


class Engine:
    def sync_weights(self, model: torch.nn.Module) -> None:
        self.synced = model


def _trainer(model_dir: Path, run_dir: Path) -> SimpleNamespace:
    """A training state built as the trainer builds it, and what a checkpoint is written with."""
    config = build_config(
        {
            "model": {"name": str(model_dir), "precision": "float32"},
            "optim": {"lr": 1e-2, "warmup_steps": 2},
            "sampling": {"greso": True, "greso_history": 2},
            "temperature": {"schedule": "adaptive"},
            "train": {"steps": 5},
        }
    )
    policy = load_policy(config.model, str(model_dir))
    tokenizer = load_tokenizer(model_dir)
    optimizer, scheduler = build_optimizer(policy, config.optim, 5, fused=False)
    rows = [{"prompt": "1 + 1?"}] * 4
    producer = InProcessProducer(config, DistInfo(), rows, None, tokenizer, policy, Engine(), None)
    state = TrainingState(
        policy,
        optimizer,
        scheduler,
        reference=None,
        critic=None,
        entropy_bonus=EntropyBonus(config.algorithm),
        hack_watch=HackWatch(config.train.hack_watch, config.rewards.functions),
        producer=producer,
    )
    return SimpleNamespace(
        state=state,
        config=config,
        dist=DistInfo(),
        run=RunDir(run_dir),
        tokenizer=tokenizer,
        inputs={"data": None, "model": "m0"},
    )


def written_with(t: SimpleNamespace) -> WrittenWith:
    return WrittenWith(t.dist, t.tokenizer, t.config, t.inputs)


def test_a_checkpoint_restores_weights_optimizer_schedule_rng_and_the_run_state(
    tiny_model_dir: Path, tmp_path: Path, weights
) -> None:
    saved = _trainer(tiny_model_dir, tmp_path / "run")
    saved.run.path.mkdir()
    # three steps of training: weights, Adam's moments and the schedule all move
    ids = torch.tensor([[1, 2, 3, 4]])
    for _ in range(3):
        saved.state.policy(input_ids=ids, labels=ids).loss.backward()
        saved.state.optimizer.step()
        saved.state.optimizer.zero_grad()
        saved.state.scheduler.step()
    saved.state.step, saved.state.producer.stream.consumed = 3, 24
    saved.state.producer.prompt_filter.record(5, True)
    saved.state.producer.temperature.observe({"frac_zero_std": 0.9, "truncated_frac": 0.0})
    saved.state.hack_watch.format.append(0.25)
    saved.state.hack_watch.length.add(30.0, window=4)
    saved.state.hack_watch.raised.add("hack/format_only")
    save_checkpoint(saved.state, saved.run, written_with(saved))
    next_draws = (torch.rand(3), random.random())  # what the run draws after its checkpoint

    path = saved.run.checkpoints / "step-3"
    found = Checkpoint.read(path)
    assert (found.step, found.world_size, found.inputs) == (3, 1, saved.inputs)
    assert found.config == saved.config.model_dump(mode="json")
    assert saved.run.intact == path

    fresh = _trainer(tiny_model_dir, tmp_path / "run")
    weights.assert_moved(weights.of(fresh.state.policy), weights.of(saved.state.policy))
    load_checkpoint(fresh.state, path, dist=fresh.dist, config=fresh.config)
    weights.assert_equal(weights.of(fresh.state.policy), weights.of(saved.state.policy))
    # Adam's step count and both moments of every parameter
    saved_state, fresh_state = (
        t.optimizer.state_dict()["state"] for t in (saved.state, fresh.state)
    )
    assert saved_state and fresh_state.keys() == saved_state.keys()
    for index, moments in saved_state.items():
        for key, value in moments.items():
            assert torch.equal(fresh_state[index][key], value), (index, key)
    assert fresh.state.scheduler.last_epoch == 3
    assert fresh.state.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # warm-up over
    assert (fresh.state.step, fresh.state.producer.stream.consumed) == (3, 24)
    # what the producer drew and skipped, and the temperature it samples the next step at
    assert fresh.state.producer.prompt_filter.history == {5: [True]}
    temperature = fresh.state.producer.temperature
    assert temperature.state_dict() == saved.state.producer.temperature.state_dict()
    assert temperature.current == pytest.approx(1.1)  # 1.0 raised by one step of 0.1
    # the reward-hacking watch's windows and raised signals
    assert fresh.state.hack_watch.state_dict() == saved.state.hack_watch.state_dict()
    assert fresh.state.hack_watch.raised == {"hack/format_only"}
    assert (fresh.state.hack_watch.format, fresh.state.hack_watch.length.recent) == ([0.25], [30.0])
    # the random streams continue where the checkpoint left them
    draws = (torch.rand(3), random.random())
    assert torch.equal(draws[0], next_draws[0]) and draws[1] == next_draws[1]


def test_the_rng_state_round_trips() -> None:
    state = capture_rng()
    first = (torch.rand(4), random.random())
    restore_rng(state)
    assert torch.equal(torch.rand(4), first[0]) and random.random() == first[1]


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "step-1"
    folder.mkdir()
    torch.save({"trainable": None}, folder / "trainer_state.pt")
    save_file({"other.weight": torch.zeros(1, 2)}, folder / "model.safetensors")
    stand_in = SimpleNamespace(policy=torch.nn.Linear(2, 1))
    config = SimpleNamespace(model=SimpleNamespace(name="my-model"))
    with pytest.raises(RunDirError) as refused:
        load_checkpoint(stand_in, folder, dist=DistInfo(), config=config)
    assert str(refused.value) == (
        f"checkpoint {folder} does not fit the model my-model as configured (were its files "
        f"changed?): checkpoint {folder} does not match the model: ['other.weight']"
    )


def test_steps_made_ahead_in_a_checkpoint_from_before_producer_process_load(
    tmp_path: Path, monkeypatch
) -> None:
    # written when the producer process was grpo.training.ahead and a step's seconds, skips
    # and temperature travelled in a dict (``clock``)
    @dataclass
    class Produced:
        step: int
        version: int
        collected: str
        clock: dict
        state: dict

    old = types.ModuleType("grpo.training.ahead")
    Produced.__module__, Produced.__qualname__, old.Produced = old.__name__, "Produced", Produced
    monkeypatch.setitem(sys.modules, old.__name__, old)
    clock = {"rollout": 1.0, "reward": 2.0, "skipped": 3.0, "wait_train": 4.0, "temperature": 0.7}
    save_torch({"ahead": [Produced(2, 1, "groups", clock, {"consumed": 8})]}, tmp_path / "s.pt")
    monkeypatch.delitem(sys.modules, old.__name__)

    loaded = load_torch(tmp_path / "s.pt")["ahead"][0]
    assert type(loaded) is producer_process.Produced
    assert (loaded.step, loaded.version, loaded.state) == (2, 1, {"consumed": 8})
    assert loaded.made == ProducedStep("groups", 0.7, rollout_s=1.0, reward_s=2.0, skipped=3.0)
    assert loaded.wait_train_s == 4.0


def test_rollouts_in_a_checkpoint_from_before_step_data_and_decoding_load(
    tmp_path: Path, monkeypatch
) -> None:
    # written when the step's data types lived in grpo.containers, the decoding controls were the
    # class Sampling and a rollout held them as ``sampling``
    @dataclass
    class Rollout:
        group_size: int
        sampling: object

    @dataclass(frozen=True)
    class Sampling:
        temperature: float = 1.0
        top_p: float = 1.0

    old = types.ModuleType("grpo.containers")
    Rollout.__module__, Rollout.__qualname__, old.Rollout = old.__name__, "Rollout", Rollout
    monkeypatch.setitem(sys.modules, old.__name__, old)
    Sampling.__module__, Sampling.__qualname__ = "grpo.scoring.distribution", "Sampling"
    monkeypatch.setattr(distribution, "Sampling", Sampling, raising=False)
    save_torch({"ahead": [Rollout(4, Sampling(temperature=0.7))]}, tmp_path / "s.pt")
    monkeypatch.delitem(sys.modules, old.__name__)
    monkeypatch.delattr(distribution, "Sampling")

    (loaded,) = load_torch(tmp_path / "s.pt")["ahead"]
    assert type(loaded) is step_data.Rollout and loaded.group_size == 4
    assert "sampling" not in vars(loaded)
    assert type(loaded.decoding) is distribution.Decoding
    assert (loaded.decoding.temperature, loaded.decoding.top_p) == (0.7, 1.0)
