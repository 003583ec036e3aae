"""The builder: the parts it builds, in what order, and what it releases when a part fails."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import grpo.build
from grpo.build import build_for_sampling
from grpo.config import DataConfig, ModelConfig, build_config
from grpo.data import DataError
from grpo.data.prompts import prompt_format_for
from grpo.models import ModelError, load_tokenizer
from grpo.rewards import RewardError, RewardRunner
from grpo.rollout.turns import MultiTurnEngine


def _config(model: Path, **rewards: object):
    return build_config(
        {
            "model": {"name": str(model), "precision": "float32"},
            "data": {"task": "arithmetic", "task_args": {"size": 8}},
            "rewards": {"functions": [{"name": "format"}], **rewards},
            "train": {"progress": False},
        }
    )


@pytest.fixture
def closed(monkeypatch) -> list[bool]:
    """One True per close of a reward runner (the real close runs too)."""
    calls: list[bool] = []
    real_close = RewardRunner.close

    def close(self: RewardRunner) -> None:
        calls.append(True)
        real_close(self)

    monkeypatch.setattr(RewardRunner, "close", close)
    return calls


def test_a_bad_reward_is_refused_before_the_model_loads(tiny_model_dir: Path, monkeypatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded before the rewards were checked")

    monkeypatch.setattr(grpo.build, "load_policy", never)
    monkeypatch.setattr(grpo.build, "load_tokenizer", never)
    bad = build_config(
        {
            "model": {"name": str(tiny_model_dir), "precision": "float32"},
            "rewards": {"functions": [{"name": "no_such_reward"}]},
        }
    )
    with pytest.raises(RewardError, match="unknown reward 'no_such_reward'"):
        build_for_sampling(bad, [])


def test_the_rewards_are_closed_when_the_model_fails_to_load(
    tiny_model_dir: Path, monkeypatch, closed: list[bool]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ModelError("weights are damaged")

    monkeypatch.setattr(grpo.build, "load_policy", broken)
    with pytest.raises(ModelError, match="damaged"):
        build_for_sampling(_config(tiny_model_dir), [])
    assert closed == [True]


def test_eval_parts_hold_no_engine_and_a_model_in_eval_mode(tiny_model_dir: Path) -> None:
    parts = build_for_sampling(_config(tiny_model_dir), [{"prompt": "What is 1 + 1?"}])
    try:
        assert not parts.policy.training
        assert not hasattr(parts, "engine")  # eval generates itself; curate builds its engine
    finally:
        parts.rewards.close()


def test_a_trainer_that_fails_to_build_stops_its_reward_workers(
    tiny_config, monkeypatch, closed: list[bool]
) -> None:
    from grpo.training import Trainer

    def broken(*args: object, **kwargs: object) -> None:
        raise ModelError("weights are damaged")

    monkeypatch.setattr(grpo.build, "load_policy", broken)
    with pytest.raises(ModelError, match="damaged"):
        Trainer(tiny_config())
    assert closed == [True]


def test_an_unknown_engine_is_named() -> None:
    with pytest.raises(ValueError, match=r"^unknown rollout engine 'tpu'$"):
        grpo.build.build_engine("tpu")


def test_the_tool_loop_wraps_an_engine_once(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    inner = SimpleNamespace(eos=[tokenizer.eos_token_id], generate_turns=None, sync_weights=None)
    plain = build_config({"model": {"name": str(tiny_model_dir), "precision": "float32"}})
    assert grpo.build.engine_of(plain, None, tokenizer, inner) is inner  # no tools: as it is
    tools = build_config(
        {
            "model": {"name": str(tiny_model_dir), "precision": "float32"},
            "rollout": {"tools": ["python"]},
        }
    )
    wrapped = grpo.build.engine_of(tools, None, tokenizer, inner)
    assert isinstance(wrapped, MultiTurnEngine) and wrapped.engine is inner
    assert grpo.build.engine_of(tools, None, tokenizer, wrapped) is wrapped  # not twice


def test_the_reference_follows_beta_its_refreshes_and_autocast() -> None:
    policy = torch.nn.Linear(2, 2)

    def reference(**algorithm: object):
        config = build_config({"algorithm": algorithm, "model": {"autocast": True}})
        return grpo.build.reference_of(config, policy)

    assert reference(beta=0.0) is None  # nothing loaded at all
    # never refreshed: a copy (alpha 1) held in bf16; a mix without refreshes is refused
    frozen = reference(beta=0.04)
    assert frozen.alpha == 1.0 and frozen.copy.weight.dtype == torch.bfloat16
    assert frozen.copy is not policy and torch.equal(
        frozen.copy.weight.float(), policy.weight.bfloat16().float()
    )
    mixing = reference(beta=0.04, ref_update_every=2, ref_mix_alpha=0.5)
    assert mixing.alpha == 0.5 and mixing.copy.weight.dtype == torch.float32


def test_a_reward_that_needs_a_missing_column_is_closed_with_its_error(
    monkeypatch, closed: list[bool]
) -> None:
    config = build_config({"rewards": {"functions": [{"name": "accuracy"}]}})
    with pytest.raises(RewardError, match="reads the column 'answer', which no row"):
        grpo.build.reward_runner(config, [{"prompt": "1 + 1?"}])
    assert closed == [True]
    grpo.build.reward_runner(config, [{"prompt": "1 + 1?", "answer": "2"}]).close()
    assert closed == [True, True]  # the caller's close: none in between


def test_rows_are_checked_before_the_weights_load(tiny_model_dir: Path, monkeypatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights loaded before the rows were checked")

    monkeypatch.setattr(grpo.build, "load_policy", never)
    fmt = prompt_format_for(DataConfig(template="Q: {question}"), None)
    with pytest.raises(DataError, match="question"):
        grpo.build.load_model(
            ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir), fmt, [{"prompt": "x"}]
        )


def test_run_parts_claims_the_run_between_the_inputs_and_the_model(
    tiny_model_dir: Path, monkeypatch
) -> None:
    order: list[str] = []
    real_load = grpo.build.load_policy

    def load(*args: object, **kwargs: object) -> torch.nn.Module:
        order.append("model")
        return real_load(*args, **kwargs)

    def claim(config: object, inputs: grpo.build.RunInputs) -> None:
        order.append(f"claim with {len(inputs.rows)} rows")

    monkeypatch.setattr(grpo.build, "load_policy", load)
    config = _config(tiny_model_dir)
    parts = grpo.build.run_parts(config, grpo.build.Given(), torch.device("cpu"), claim)
    parts.inputs.close()
    assert order == ["claim with 8 rows", "model"]
    assert parts.inputs.model_path == str(tiny_model_dir) and parts.policy.training
    assert parts.reference is not None  # the default beta > 0
    assert parts.inputs.verifier is None  # no held-out evaluation


def test_a_refused_claim_stops_the_reward_workers_and_loads_no_model(
    tiny_model_dir: Path, monkeypatch, closed: list[bool]
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded after the claim was refused")

    def refused(config: object, inputs: object) -> None:
        raise DataError("the run directory holds another run")

    monkeypatch.setattr(grpo.build, "load_policy", never)
    with pytest.raises(DataError, match="another run"):
        grpo.build.run_parts(
            _config(tiny_model_dir), grpo.build.Given(), torch.device("cpu"), refused
        )
    assert closed == [True]


def test_a_prompt_past_the_models_positions_is_one_line_before_training(
    tiny_config, capsys
) -> None:
    # the tiny model has 512 positions; its tokenizer spells "7 " as two tokens, so 300 of them
    # render as 603 tokens, 240 as 483 and 20 as 43
    from grpo import train

    rows = [{"prompt": "1 + 1", "answer": "2"}] * 3 + [{"prompt": "7 " * 300, "answer": "7"}]
    config = tiny_config()
    with pytest.raises(DataError) as refused:
        train(config, dataset=rows)
    assert str(refused.value) == (
        "data row 4: its prompt is 603 tokens, as many as the model's 512 positions or more; "
        "shorten it"
    )
    assert not (config.run_dir / "metrics.jsonl").exists()
    fmt, tokenizer = prompt_format_for(DataConfig(), None), load_tokenizer(config.model.name)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512))

    def check(prompts: list[str]) -> str:
        rows = [{"prompt": p} for p in prompts]
        grpo.build.check_prompt_lengths(rows, fmt, tokenizer, model, config.rollout, "data")
        return capsys.readouterr().err

    # 483 + 12 new tokens fit: nothing said; 483 + 40 can pass the positions: one line
    assert check(["7 " * 20, "7 " * 240]) == ""
    config.rollout.max_new_tokens = 40
    said = check(["7 " * 20, "7 " * 240])
    assert said.startswith("warning: data row 2's prompt is 483 tokens: with ")
    assert said.count("\n") == 1 and "rollout.max_new_tokens=40" in said


def test_a_run_takes_the_thread_count_it_is_given() -> None:
    # the tests run with one thread (conftest): train.threads must still set the count
    before = torch.get_num_threads()
    try:
        grpo.build.prepare_process(build_config({"train": {"threads": 3}}))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
