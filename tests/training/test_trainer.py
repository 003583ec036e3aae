"""End to end: a short run writes its outputs, a toy reward is learned, resume is exact."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.config import ConfigError
from grpo.models import is_lora
from grpo.scoring.logprobs import completion_logprobs
from grpo.training.micro_batches import micro_batches
from grpo.training.trainer import Trainer, train

TOY_REWARD = '''
def share_of_a(completions, **kwargs):
    """Share of completion characters that are the letter 'a'."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def noisy(completions, **kwargs):
    """A reward that almost surely differs within a group, so every group has a gradient."""
    return [float(sum(map(ord, c)) % 7) for c in completions]
'''


@pytest.fixture
def toy_reward(tmp_path: Path) -> dict:
    """A rewards section whose reward the tiny model can move: the share of 'a' characters."""
    reward_file = tmp_path / "toy_reward.py"
    reward_file.write_text(TOY_REWARD)
    return {"functions": [{"name": f"{reward_file}:share_of_a"}]}


@pytest.fixture
def noisy_reward(toy_reward: dict) -> dict:
    path = toy_reward["functions"][0]["name"].rpartition(":")[0]
    return {"functions": [{"name": f"{path}:noisy"}]}


def _metrics(run_dir: Path) -> list[dict]:
    """Each step's metrics (without event rows, such as where a resume continued)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "event" not in row]


@pytest.mark.device
def test_short_run_writes_metrics_completions_and_a_loadable_checkpoint(
    tiny_config, tiny_model_dir, weights
) -> None:
    config = tiny_config(train={"steps": 2, "save_every": 1, "log_completions": 3})
    run_dir = train(config)
    weights.assert_moved(weights.of(tiny_model_dir), weights.of(run_dir / "final"))
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for name in (
        "reward/mean",
        "reward/std",
        "reward/format/mean",
        "reward/accuracy/mean",
        "reward/lowercase_share/mean",
        "frac_zero_std",
        "advantage/abs_mean",
        "kl",
        "entropy",
        "clip_frac/low",
        "clip_frac/high",
        "completion_len/mean",
        "truncated_frac",
        "loss",
        "grad_norm",
        "lr",
        "time/rollout_s",
        "time/reward_s",
        "time/train_s",
        "tokens_per_s",
    ):
        assert name in metrics[0], name
    lines = (run_dir / "completions" / "step-000002.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert len(lines) == 3 and {"prompt", "completion", "reward", "advantage"} <= set(record)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-2"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-2")
    assert model.config.num_hidden_layers == 2
    assert (run_dir / "config.yaml").is_file() and (run_dir / "final" / "config.json").is_file()
    # the trainable reward gives every step a gradient, and the logged numbers say so
    for m in metrics:
        assert m["advantage/abs_mean"] > 0.1 and m["grad_norm"] > 0, m
        assert m["time/rollout_s"] > 0 and m["time/reward_s"] > 0, m


def test_keep_last_prunes_old_checkpoints(tiny_config) -> None:
    run_dir = train(tiny_config(train={"steps": 4, "save_every": 1, "keep_last": 2}))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-3", "step-4"]


def test_tiny_model_learns_a_toy_reward(tiny_config, toy_reward) -> None:
    config = tiny_config(
        rewards=toy_reward,
        rollout={"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 8},
        algorithm={"beta": 0.0},
        optim={"lr": 3e-3, "micro_batch_size": 16},
        train={"steps": 30, "seed": 1},
    )
    rewards = [m["reward/mean"] for m in _metrics(train(config))]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # a random 100-token vocabulary gives ~0.01 per token; learning must clearly beat it
    assert last > first + 0.2, (first, last)


@pytest.mark.device
def test_resume_matches_an_uninterrupted_run(
    tiny_config, tiny_model_dir, weights, deterministic
) -> None:
    # the default tiny_config reward moves the weights on every step, so optimizer state,
    # scheduler, RNG and data order all have to come back exactly for the two runs to agree
    # (checked by hand: this test fails when optimize() stops calling zero_grad)
    straight = tiny_config(train={"steps": 6, "run_name": "straight"})
    straight_dir = train(straight)
    part = tiny_config(train={"steps": 3, "run_name": "resumed"})
    half_dir = train(part)
    start, half = weights.of(tiny_model_dir), weights.of(half_dir / "final")
    weights.assert_moved(start, half)
    resumed_dir = train(tiny_config(train={"steps": 6, "run_name": "resumed"}))
    a, b = weights.of(straight_dir / "final"), weights.of(resumed_dir / "final")
    weights.assert_moved(half, b)  # the resumed half trained too
    weights.assert_equal(a, b)

    def strip(ms: list[dict]) -> list[dict]:
        return [
            {k: v for k, v in m.items() if not k.startswith("time/") and k != "tokens_per_s"}
            for m in ms
        ]

    assert strip(_metrics(straight_dir)) == strip(_metrics(resumed_dir))


def test_a_bf16_run_resumes_bit_exact_from_its_float32_masters(
    tiny_config, tiny_model_dir, weights
) -> None:
    # at lr 1e-4 the float32 masters hold updates their bf16 roundings lost: a resume from the
    # HF folder's bf16 weights alone ends elsewhere (checked by hand: saving no masters fails)
    def config(steps: int, name: str):
        return tiny_config(
            model={"dtype": "bfloat16"},
            optim={"lr": 1e-4},
            train={"steps": steps, "run_name": name},
        )

    straight_dir = train(config(4, "straight"))
    half_dir = train(config(2, "resumed"))
    state = torch.load(half_dir / "checkpoints" / "step-2" / "trainer_state.pt")
    half = weights.of(half_dir / "final")
    assert {k: v.dtype for k, v in state["master"].items()} == {
        k: torch.float32 for k in half if k != "lm_head.weight"
    }
    # the masters hold what the bf16 weights cannot: their rounding is the saved weights
    for name, master in state["master"].items():
        assert torch.equal(master.bfloat16(), half[name]), name
    assert any(not torch.equal(m, m.bfloat16().float()) for m in state["master"].values())
    resumed_dir = train(config(4, "resumed"))
    a, b = weights.of(straight_dir / "final"), weights.of(resumed_dir / "final")
    weights.assert_moved(half, b, atol=1e-5)
    weights.assert_equal(a, b)
    assert _metrics(straight_dir)[-1]["loss"] == _metrics(resumed_dir)[-1]["loss"]


def test_lora_reference_is_the_adapter_disabled_policy(
    tiny_config, tiny_model_dir, weights, monkeypatch
) -> None:
    config = tiny_config(
        model={"lora": {"enabled": True, "r": 4}},
        algorithm={"beta": 0.1},
        optim={"lr": 1e-2},
        train={"steps": 3},
    )
    trainer = Trainer(config)
    assert trainer.state.reference.copy is None  # no second copy of the weights
    total = sum(p.numel() for p in trainer.state.policy.parameters())
    trainable = sum(p.numel() for p in trainer.state.policy.parameters() if p.requires_grad)
    assert trainable < total / 5
    calls = _spy_policy_loss(monkeypatch, with_ref=True)
    run_dir = trainer.train()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert not any("lora" in k for k in merged.state_dict())
    weights.assert_moved(weights.of(tiny_model_dir), weights.of(run_dir / "final"))

    # the reference log-probs the loss saw on the last step are the base model's, while the
    # trained policy's differ from them
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = calls[-1]["batch"]
    with torch.no_grad():
        base_logp, _ = completion_logprobs(base, *batch, config.rollout.temperature)
        policy_logp, _ = completion_logprobs(
            trainer.state.policy, *batch, config.rollout.temperature
        )
    mask = batch[3]
    ref_logp = calls[-1]["ref"]
    assert torch.allclose(ref_logp[mask], base_logp[mask], atol=1e-5)
    assert (policy_logp - base_logp)[mask].abs().max() > 1e-3
    assert trainer.state.reference.copy is None and is_lora(
        trainer.state.policy
    )  # still the live adapter


def test_no_reference_model_when_beta_is_zero(tiny_config) -> None:
    assert Trainer(tiny_config(algorithm={"beta": 0.0})).state.reference is None


def _spy_policy_loss(monkeypatch, with_ref: bool = False) -> list:
    """Records (logp, old_logp) of every policy_loss call; with_ref: dicts that also hold the
    reference log-probs and the micro-batch's (prompt ids/mask, completion ids/mask)."""
    import grpo.training.trainer
    import grpo.training.update
    from grpo import algorithm

    calls: list = []
    original = algorithm.policy_loss
    original_logprobs = grpo.training.update.completion_logprobs
    last_batch: list = []

    def logprobs_spy(model, *batch, **kwargs):
        last_batch[:] = [t.detach().clone() for t in batch[:4]]
        return original_logprobs(model, *batch, **kwargs)

    def spy(logp, old_logp, advantages, loss_mask, ref_logp=None, **kwargs):
        if with_ref:
            calls.append({"ref": ref_logp.detach().clone(), "batch": list(last_batch)})
        else:
            calls.append((logp.detach().clone(), old_logp.detach().clone()))
        return original(logp, old_logp, advantages, loss_mask, ref_logp, **kwargs)

    monkeypatch.setattr(algorithm, "policy_loss", spy)
    monkeypatch.setattr(grpo.training.update, "completion_logprobs", logprobs_spy)
    return calls


def test_several_policy_iterations_use_old_logprobs(tiny_config, noisy_reward, monkeypatch) -> None:
    config = tiny_config(
        rewards=noisy_reward,
        algorithm={"num_iterations": 2, "beta": 0.0},
        optim={"lr": 1e-2, "micro_batch_size": 8},
    )
    trainer = Trainer(config)
    scored = trainer.producer.score(trainer.producer.rollout())
    calls = _spy_policy_loss(monkeypatch)
    trainer.optimize(scored)
    (logp1, old1), (logp2, old2) = calls  # one micro-batch, two optimizer steps
    assert torch.allclose(logp1, old1, atol=1e-5)  # first pass is on-policy: ratio 1
    assert torch.allclose(old2, old1, atol=1e-5)  # old log-probs are frozen at sampling time
    mask = scored.rollout.completion_mask[:, : logp2.shape[1]]
    assert (logp2 - old2)[mask].abs().max() > 1e-4  # the second pass sees a moved policy


def test_one_iteration_needs_no_extra_forward(tiny_config, monkeypatch) -> None:
    import grpo.training.trainer
    import grpo.training.update

    trainer = Trainer(tiny_config(algorithm={"beta": 0.0}, optim={"micro_batch_size": 4}))
    scored = trainer.producer.score(trainer.producer.rollout())
    calls = []
    original = grpo.training.update.completion_logprobs

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo.training.update, "completion_logprobs", counting)
    trainer.optimize(scored)
    # 8 completions / micro-batch 4: two log-prob passes, both the gradient passes; no reference
    # (beta 0) and no old log-probs (mu 1) forward
    assert calls == [True, True]


def test_an_update_frees_its_gradients_once_its_step_is_taken(tiny_config) -> None:
    trainer = Trainer(tiny_config())
    scored = trainer.producer.score(trainer.producer.rollout())
    before = [p.detach().clone() for p in trainer.state.policy.parameters()]
    trainer.optimize(scored)
    # the step moved the weights, and the gradients are gone once it is taken: the rollout and
    # the frozen log-probs until the next update reuse their memory
    params = trainer.state.policy.parameters()
    assert any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert all(p.grad is None for p in trainer.state.policy.parameters())


def test_a_step_whose_gradient_is_not_finite_leaves_the_weights_and_says_so(
    tiny_config, capsys
) -> None:
    trainer = Trainer(tiny_config())
    scored = trainer.producer.score(trainer.producer.rollout())
    before = [p.detach().clone() for p in trainer.state.policy.parameters()]
    weight = next(p for p in trainer.state.policy.parameters() if p.requires_grad)
    hook = weight.register_hook(lambda grad: grad * float("nan"))  # as a diverged loss gives
    trainer.state.step = 1
    out = trainer.optimize(scored)
    assert math.isnan(out["grad_norm"]) and out["optim/skipped"] == 1.0
    params = list(trainer.state.policy.parameters())
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    said = [line for line in capsys.readouterr().err.splitlines() if "not finite" in line]
    assert len(said) == 1 and "step 1" in said[0] and "skipped" in said[0]
    assert trainer.state.scheduler.last_epoch == 0 and all(p.grad is None for p in params)
    hook.remove()
    trainer.optimize(scored)  # the next finite step moves them
    assert any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))


@pytest.mark.parametrize("nan_passes", [1, None], ids=["first-step", "both-steps"])
def test_skipped_is_the_share_of_an_updates_optimizer_steps_not_taken(
    tiny_config, nan_passes
) -> None:
    # mu = 2 optimizer steps on one batch: a non-finite gradient in the first backward pass
    # skips the first step only (1 of 2), in every pass both
    trainer = Trainer(tiny_config(algorithm={"num_iterations": 2}))
    scored = trainer.producer.score(trainer.producer.rollout())
    weight = next(p for p in trainer.state.policy.parameters() if p.requires_grad)
    passes: list[int] = []

    def poison(grad: torch.Tensor) -> torch.Tensor:
        passes.append(1)
        return grad * float("nan") if nan_passes is None or len(passes) <= nan_passes else grad

    hook = weight.register_hook(poison)
    out = trainer.optimize(scored)
    hook.remove()
    assert out["optim/skipped"] == (0.5 if nan_passes else 1.0)


def test_an_entropy_target_adapts_the_coefficient_from_the_updates_entropy(tiny_config):
    # the controller reads the mean token entropy the update measured: under a target no
    # model reaches, the step used 0 and the next one takes a step up
    algo = {"entropy_target": 50.0, "entropy_coef_step": 0.25, "beta": 0.0}
    trainer = Trainer(tiny_config(algorithm=algo))
    out = trainer.optimize(trainer.producer.score(trainer.producer.rollout()))
    assert 0 < out["entropy"] < 50.0
    assert out["entropy/coef"] == 0.0 and trainer.update.entropy_bonus.coef == 0.25


INFORMATIVE_OR_EQUAL = """
def share_or_half(completions, *, informative, **kwargs):
    \"\"\"Lowercase share (varies within a group) on informative rows, else 0.5 for all.\"\"\"
    return [
        sum(ch.islower() for ch in text) / max(len(text), 1) if flag else 0.5
        for text, flag in zip(completions, informative)
    ]
"""


@pytest.mark.parametrize("dynamic", [False, True], ids=["zero-gradient", "dynamic-sampling"])
def test_a_step_with_nothing_to_learn_leaves_the_weights_and_the_schedule(
    tiny_config, tiny_model_dir, tmp_path, weights, dynamic: bool
) -> None:
    # in order, 2 prompts a step: step 2's rows reward every completion alike; with beta 0 its
    # gradient is exactly zero, and Adam's momentum from step 1 must not move the weights; a
    # dynamic-sampling step (one round) that keeps no group behaves the same
    rows = [{"prompt": f"q{i}", "answer": "0", "informative": i // 2 != 1} for i in range(6)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reward = tmp_path / "share_or_half.py"
    reward.write_text(INFORMATIVE_OR_EQUAL)
    config = tiny_config(
        data={"path": str(data), "shuffle": False},
        rewards={"functions": [{"name": f"{reward}:share_or_half"}]},
        algorithm={"beta": 0.0},
        optim={"lr": 1e-3, "warmup_steps": 4},
        sampling={"dynamic": dynamic, "max_rounds": 1},
        train={"steps": 3, "save_every": 1, "keep_last": 3},
    )
    run_dir = train(config)
    saved = [weights.of(tiny_model_dir)] + [
        weights.of(run_dir / "checkpoints" / f"step-{n}") for n in (1, 2, 3)
    ]
    weights.assert_moved(saved[0], saved[1])
    weights.assert_equal(saved[1], saved[2])
    weights.assert_moved(saved[2], saved[3])
    metrics = _metrics(run_dir)
    assert [m["frac_zero_std"] for m in metrics] == [0.0, 1.0, 0.0]
    assert [m["optim/skipped"] for m in metrics] == [0.0, 1.0, 0.0]
    assert metrics[1].get("grad_norm", 0.0) == 0.0  # dynamic sampling: no update to measure
    # warm-up factor (k + 1) / 5 after k optimizer steps: the skipped step does not count, as
    # a dynamic-sampling step with nothing to learn takes none
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3 / 5, 2e-3 / 5, 2e-3 / 5])


def test_micro_batches_keep_groups_whole_longest_first_with_their_advantages(
    tiny_config,
) -> None:
    trainer = Trainer(tiny_config(rollout={"prompts_per_step": 3, "group_size": 4}))
    rollout = trainer.producer.rollout()
    # completions of varied lengths (the random model rarely stops on its own): row i keeps
    # its first 1 + (5 * i) % 12 tokens
    lengths = [1 + (5 * i) % 12 for i in range(rollout.num_completions)]
    rollout.completion_mask = torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]
    advantages = trainer.producer.score(rollout).advantages
    assert advantages.abs().min() > 0  # every row carries a real advantage
    batches = micro_batches(rollout, advantages, 3)

    # expected order, by a loop: groups by packed size (prompt + its completions) descending,
    # ties in group order, each group's rows in their own order
    prompt_len = rollout.prompt_mask.sum(dim=1).tolist()
    size = [prompt_len[4 * g] + sum(lengths[4 * g : 4 * g + 4]) for g in range(3)]
    groups = sorted(range(3), key=lambda g: -size[g])
    assert size[groups[0]] > size[groups[-1]]  # the order is not the identity by accident
    expected = [4 * g + j for g in groups for j in range(4)]
    assert torch.cat([b.index for b in batches]).tolist() == expected
    assert [len(b.index) for b in batches] == [3, 3, 3, 3]
    for b in batches:
        rows = b.index.tolist()
        assert torch.equal(b.advantages, advantages[rows])  # advantages travel with their rows
        t = max(lengths[r] for r in rows)
        s = max(prompt_len[r] for r in rows)
        assert b.completion_mask.shape[1] == t and b.prompt_mask.shape[1] == s  # trimmed
        assert torch.equal(b.completion_ids, rollout.completion_ids[rows, :t])
        assert torch.equal(b.completion_mask, rollout.completion_mask[rows, :t])
        assert torch.equal(b.prompt_ids, rollout.prompt_ids[rows, -s:])


def test_a_rank_without_prompts_rolls_out_and_scores_nothing(tiny_config) -> None:
    # dynamic sampling's later rounds may hold fewer prompts than ranks: rank 2 of 4 gets none
    # of 2, and still returns a rollout and scores that join the others' (group size, names)
    trainer = Trainer(tiny_config(rollout={"prompts_per_step": 4, "group_size": 2}))
    trainer.producer.dist = dataclasses.replace(trainer.dist, rank=2, world_size=4)
    draws = [trainer.producer.stream.next_draw() for _ in range(2)]
    empty = trainer.producer.rollout(draws)
    assert empty.num_completions == 0 and empty.rows == [] and empty.group_size == 2
    scored = trainer.producer.score(empty)
    assert scored.function_names == trainer.producer.rewards.names
    assert scored.per_function.shape == (0, len(trainer.producer.rewards.names))
    assert scored.rewards.shape == scored.advantages.shape == (0,)
    assert scored.errors == {}  # no error counts: they add up with the other ranks' counts


def test_a_second_rank_takes_its_own_advantages_from_the_gathered_batch(
    tiny_config, monkeypatch
) -> None:
    # rank 1 of 2 under scale_rewards=batch: rank 0's group (rewards 4, 0) is gathered before
    # this rank's (1, 0). Centred per group: [2, -2, 0.5, -0.5]; the batch std of [4, 0, 1, 0]
    # is sqrt(10.75 / 4); rank 1 keeps the rows after rank 0's: [0.5, -0.5] / std
    from grpo.rewards import RewardOutput
    from grpo.runtime import distributed

    trainer = Trainer(
        tiny_config(
            rollout={"prompts_per_step": 1, "group_size": 2}, algorithm={"scale_rewards": "batch"}
        )
    )
    rollout = trainer.producer.rollout()
    trainer.producer.rewards = lambda *inputs: RewardOutput(
        torch.tensor([[1.0], [0.0]]), ["r"], torch.ones(1), {"r": 0}
    )

    def gather(rows: torch.Tensor) -> torch.Tensor:  # rank 0's rows, then these
        first = torch.tensor([4.0, 0.0]) if rows.is_floating_point() else torch.tensor([2])
        return torch.cat([first, rows])

    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed, "all_gather_rows", gather)
    scored = trainer.producer.score(rollout)
    std = (10.75 / 4) ** 0.5
    assert torch.allclose(scored.advantages, torch.tensor([0.5, -0.5]) / std, atol=1e-6)


def test_the_reward_runners_error_counts_reach_the_scored_batch(tiny_config) -> None:
    # the counts feed the reward error metrics and the error watch that stops a broken run
    from grpo.rewards import RewardOutput

    trainer = Trainer(tiny_config(rollout={"prompts_per_step": 1, "group_size": 2}))

    def two_fell_back(texts, prompts, columns, ids):
        return RewardOutput(torch.ones(len(texts), 1), ["r"], torch.ones(1), {"r": 2})

    trainer.producer.rewards = two_fell_back
    scored = trainer.producer.score(trainer.producer.rollout())
    assert scored.errors == {"r": 2} and scored.rewards.tolist() == [1.0, 1.0]


def test_only_the_hf_engine_generates_from_gathered_parameters(tiny_config, monkeypatch) -> None:
    # HF generate runs the policy itself (an FSDP2 policy must be whole for it); vLLM generates
    # from its own copy of the weights, so nothing is gathered for it
    import contextlib

    import grpo.training.trainer
    import grpo.training.update

    trainer = Trainer(tiny_config(rollout={"prompts_per_step": 1, "group_size": 2}))
    gathered: list = []

    @contextlib.contextmanager
    def record(model):
        gathered.append(model)
        yield

    monkeypatch.setattr(grpo.training.trainer.distributed, "full_parameters", record)
    trainer.producer.rollout()
    assert gathered == [trainer.state.policy]
    trainer.config.rollout.engine = "vllm"  # the engine object stays; only the choice is read
    trainer.producer.rollout()
    assert gathered == [trainer.state.policy]


def test_progress_off_means_no_bars_at_all(tiny_config, capfd) -> None:
    from transformers.utils import logging

    logging.enable_progress_bar()
    train(tiny_config(train={"steps": 1, "progress": False}))
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err, err[-500:]
    assert logging.is_progress_bar_enabled()  # as they were, once the run ends
    with pytest.raises(ConfigError):  # and when the trainer cannot be built
        Trainer(tiny_config(train={"progress": False, "resume": "force", "run_name": "none"}))
    assert logging.is_progress_bar_enabled()
