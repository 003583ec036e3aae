"""Reference refresh: exact copies, soft mixing, the LoRA adapter snapshot, and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.config import ModelConfig
from grpo.models import Reference, load_policy
from grpo.training.trainer import Trainer

IDS = torch.tensor([[10, 11, 12, 13, 14, 15]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def perturb(model: torch.nn.Module, trainable_only: bool = False, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or not trainable_only:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_full_refresh_copies_weights_exactly(tiny_model_dir: Path) -> None:
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = Reference(policy)
    perturb(policy)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(reference.copy.state_dict()[name], policy.state_dict()[name])
    reference.refresh()
    ref_state, pol_state = reference.copy.state_dict(), policy.state_dict()
    assert ref_state.keys() == pol_state.keys()
    for key in pol_state:
        assert torch.equal(ref_state[key], pol_state[key]), key
    assert not any(p.requires_grad for p in reference.copy.parameters())  # still frozen
    assert reference.refreshes == 1


def test_soft_refresh_mixes(tiny_model_dir: Path) -> None:
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = Reference(policy, alpha=0.25)
    before = {k: v.clone() for k, v in reference.copy.state_dict().items()}
    perturb(policy)
    reference.refresh()
    # ref <- 0.25 * policy + 0.75 * ref, parameter by parameter
    for key, value in policy.state_dict().items():
        expected = 0.25 * value + 0.75 * before[key]
        assert torch.allclose(reference.copy.state_dict()[key], expected, atol=1e-6), key


@pytest.mark.parametrize("tied", [True, False])
def test_a_bf16_reference_scores_as_autocast_does_over_float32(
    tiny_model_dir: Path, tied: bool
) -> None:
    # autocast multiplies in bf16 anyway: linear weights stored in bf16 give the very same
    # logits; a head tied to the embedding stays float32 (the lookup is no product)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=tied)
    perturb(policy)  # an untied head must not start as a copy of the embedding
    lean, full = Reference(policy, torch.bfloat16), Reference(policy)
    head = lean.copy.lm_head.weight
    assert head.dtype == (torch.float32 if tied else torch.bfloat16)
    assert lean.copy.model.embed_tokens.weight.dtype == torch.float32
    assert lean.copy.model.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(logits(lean.copy), logits(full.copy))


def test_a_bf16_reference_is_kept_only_where_refreshes_copy(tiny_model_dir: Path) -> None:
    # a copy rounds the policy as autocast would; a mix rounded to bf16 would lose every step
    # under half a bf16 unit, so a reference that mixes keeps float32 weights
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = Reference(policy, torch.bfloat16)
    perturb(policy)
    reference.refresh()
    name = "model.layers.0.mlp.up_proj.weight"
    want = policy.state_dict()[name].bfloat16()
    assert torch.equal(reference.copy.state_dict()[name], want)
    mixing = Reference(policy, torch.bfloat16, alpha=0.3)
    assert mixing.copy.state_dict()[name].dtype == torch.float32


def test_reference_state_is_empty_until_refreshed(tiny_model_dir: Path) -> None:
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = Reference(policy)
    assert reference.state_dict() == {}  # a checkpoint need not carry the start weights
    reference.refresh()
    other = Reference(policy)
    perturb(policy)
    other.load_state_dict(reference.state_dict())
    assert torch.equal(logits(other.copy), logits(reference.copy))


@pytest.fixture
def lora_policy(tiny_model_dir: Path) -> torch.nn.Module:
    config = ModelConfig(name=str(tiny_model_dir), lora={"enabled": True, "r": 4})
    policy = load_policy(config, str(tiny_model_dir))
    perturb(policy, trainable_only=True)  # lora_B starts at 0: give the adapter an effect
    return policy


def test_lora_refresh_snapshots_the_adapter(lora_policy: torch.nn.Module) -> None:
    reference = Reference(lora_policy)
    assert reference.copy is None
    with lora_policy.disable_adapter():
        base = logits(lora_policy)
    with reference.model() as model:
        assert torch.equal(logits(model), base)  # before a refresh: the adapter-disabled base
    at_refresh = logits(lora_policy)
    assert not torch.allclose(at_refresh, base, atol=1e-4)
    reference.refresh()
    perturb(lora_policy, trainable_only=True, seed=2)  # a training step moves the adapter
    live = {n: p.detach().clone() for n, p in lora_policy.named_parameters() if p.requires_grad}
    with reference.model() as model:
        assert torch.equal(logits(model), at_refresh)  # base + the adapter snapshot
    # the live adapter is back, bit for bit, and still trainable
    for n, p in lora_policy.named_parameters():
        if n in live:
            assert torch.equal(p, live[n]) and p.requires_grad, n
    assert not torch.allclose(logits(lora_policy), at_refresh, atol=1e-4)


def test_lora_refresh_state_round_trip_and_no_mixing(lora_policy: torch.nn.Module) -> None:
    reference = Reference(lora_policy)
    reference.refresh()
    with reference.model() as model:
        expected = logits(model)
    restored = Reference(lora_policy)
    restored.load_state_dict(reference.state_dict())
    perturb(lora_policy, trainable_only=True, seed=3)
    with restored.model() as model:
        assert torch.equal(logits(model), expected)
    with pytest.raises(ValueError, match="alpha 1"):
        Reference(lora_policy, alpha=0.5)


@pytest.mark.parametrize("alpha", [0.0, 1.5, -0.2])
def test_a_reference_alpha_outside_0_1_is_refused(tiny_model_dir: Path, alpha: float) -> None:
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        Reference(AutoModelForCausalLM.from_pretrained(tiny_model_dir), alpha=alpha)


# ----------------------------------------------------------------------------- in the trainer


def _metrics(run_dir: Path) -> list[dict]:
    """Each step's metrics (without event rows, such as where a resume continued)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "event" not in row]


def test_trainer_refreshes_every_n_steps(tiny_config) -> None:
    config = tiny_config(algorithm={"beta": 0.1, "ref_update_every": 2}, train={"steps": 3})
    trainer = Trainer(config)
    run_dir = trainer.train()
    assert [m["ref/refreshes"] for m in _metrics(run_dir)] == [0.0, 1.0, 1.0]


def test_trainer_reference_equals_policy_right_after_a_refresh(tiny_config, weights) -> None:
    config = tiny_config(algorithm={"beta": 0.1, "ref_update_every": 1}, train={"steps": 2})
    trainer = Trainer(config)
    start = weights.of(trainer.state.policy)
    trainer.train()
    pol = weights.of(trainer.state.policy)
    weights.assert_moved(start, pol)  # else a reference never refreshed would also match
    weights.assert_equal(weights.of(trainer.state.reference.copy), pol)


def test_resume_restores_the_refreshed_reference(tiny_config, tmp_path, weights) -> None:
    # refreshed at step 2, so step 3 starts with policy == reference (kl 0, and k3 has no
    # gradient there); step 4's kl measures the distance to it: a resume from step 2 that lost
    # the refreshed reference would log a different kl and end with different weights.
    # The reward varies within every group, so step 3's update moves the policy.
    reward = tmp_path / "noisy.py"
    reward.write_text(
        "def noisy(completions, **kw):\n"
        "    return [float(sum(map(ord, c)) % 7) for c in completions]\n"
    )

    def config(steps: int, name: str):
        return tiny_config(
            rewards={"functions": [{"name": f"{reward}:noisy"}]},
            algorithm={"beta": 0.5, "ref_update_every": 2},
            optim={"lr": 1e-2},
            train={"steps": steps, "run_name": name},
        )

    straight = Trainer(config(4, "a")).train()
    Trainer(config(2, "b")).train()
    resumed = Trainer(config(4, "b")).train()

    def strip(ms: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if "time" not in k and "per_s" not in k} for m in ms]

    assert strip(_metrics(straight)) == strip(_metrics(resumed))
    kls = [m["kl"] for m in _metrics(resumed)]
    assert kls[2] == 0.0 and kls[3] > 1e-6
    a, b = weights.of(straight / "final"), weights.of(resumed / "final")
    weights.assert_moved(weights.of(tmp_path / "runs" / "b" / "checkpoints" / "step-2"), b)
    weights.assert_equal(a, b)
