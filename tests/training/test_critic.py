"""PPO with a critic (algorithm.estimator: ppo): GAE and the clipped value loss by hand, the
advantages the update trains on, and runs on the tiny model where both the policy and the
critic learn and a resume after kill -9 ends with the same policy and critic."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_logs import step_rows as rows
from safetensors.torch import load_file

from grpo import algorithm
from grpo.config import ConfigError, build_config
from grpo.models import load_policy
from grpo.scoring.distribution import Decoding
from grpo.scoring.packing import ScoringCost
from grpo.training import advantages
from grpo.training.critic import Critic, completion_values, value_metrics, value_model
from grpo.training.micro_batches import MicroBatch
from grpo.training.trainer import Trainer, train

TRAINABLE_REWARD = f"{Path(__file__).parents[1] / 'toy_rewards.py'}:lowercase_share"
ALL = torch.ones(1, 3, dtype=torch.bool)


# ------------------------------------------------------------------------------- by hand


def test_gae_by_hand() -> None:
    # one completion of 3 tokens, reward 1 at the end, values 0.5, 0.6, 0.8
    r = algorithm.per_token_rewards(torch.tensor([1.0]), ALL, None)
    assert r.tolist() == [[0.0, 0.0, 1.0]]
    v = torch.tensor([[0.5, 0.6, 0.8]])
    # lam 1, gamma 1: A_t = G_t - V_t = 1 - V_t
    adv, ret = algorithm.gae(r, v, ALL, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.4, 0.2]], dtype=torch.float64))
    assert torch.allclose(ret, torch.ones(1, 3, dtype=torch.float64))  # R_t = A_t + V_t
    # lam 0: one-step TD errors r_t + V_{t+1} - V_t = 0.1, 0.2, 1 - 0.8
    adv, ret = algorithm.gae(r, v, ALL, gamma=1.0, lam=0.0)
    assert torch.allclose(adv, torch.tensor([[0.1, 0.2, 0.2]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[0.6, 0.8, 1.0]], dtype=torch.float64))
    # gamma 0.9, lam 0.5: delta = 0.04, 0.12, 0.2; A_3 = 0.2, A_2 = 0.12 + 0.45 * 0.2 = 0.21,
    # A_1 = 0.04 + 0.45 * 0.21 = 0.1345
    adv, _ = algorithm.gae(r, v, ALL, gamma=0.9, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.1345, 0.21, 0.2]], dtype=torch.float64))


def test_per_token_rewards_keep_float64_rewards_exact() -> None:
    # float64 out, as documented: a float64 reward reaches its completion's last counted token
    # as it was (0.1 and 1/3 are not float32 values), with or without shaped token rewards
    rewards = torch.tensor([0.1, 1 / 3], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    r = algorithm.per_token_rewards(rewards, mask, None)
    assert r.tolist() == [[0.0, 0.1, 0.0], [1 / 3, 0.0, 0.0]]
    assert r.dtype == torch.float64


def test_gae_skips_what_the_policy_did_not_sample() -> None:
    # a tool's output (position 1) between two sampled tokens: the sampled ones chain directly,
    # as if it were not there (lam 0: A_0 = V_2 - V_0 = 0.3, A_2 = 1 - 0.8); a padded position
    # after the last counted token gets nothing
    mask = torch.tensor([[True, False, True, False]])
    r = algorithm.per_token_rewards(torch.tensor([1.0]), mask, None)
    v = torch.tensor([[0.5, 9.0, 0.8, 9.0]])
    adv, ret = algorithm.gae(r, v, mask, gamma=1.0, lam=0.0)
    assert torch.allclose(adv, torch.tensor([[0.3, 0.0, 0.2, 0.0]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[0.8, 0.0, 1.0, 0.0]], dtype=torch.float64))


def test_clipped_value_loss_by_hand() -> None:
    # returns 1; old values 0.5; new values 0.9 (moved 0.4 > clip 0.2: clipped value 0.7) and
    # 0.4 (moved -0.1: inside). Token 1: max((0.9-1)^2, (0.7-1)^2) = 0.09 (the clipped term
    # wins); token 2: (0.4-1)^2 = 0.36 both. Loss 0.5 * (0.09 + 0.36) / 2 tokens = 0.1125
    values = torch.tensor([[0.9, 0.4]], requires_grad=True)
    old, ret = torch.tensor([[0.5, 0.5]]), torch.ones(1, 2)
    loss, stats = algorithm.value_loss(values, old, ret, torch.ones(1, 2, dtype=torch.bool), 0.2, 2)
    assert float(loss.detach()) == pytest.approx(0.1125)
    assert float(stats["clip_frac"]) == pytest.approx(0.5)
    loss.backward()
    # the clipped term has no gradient (its value is held at the bound); the other's is
    # (0.4 - 1) / 2 tokens = -0.3
    assert torch.allclose(values.grad, torch.tensor([[0.0, -0.3]]))


def test_clipped_value_loss_bounds_a_move_down_too() -> None:
    # returns 0; old value 0.5; the new value 0.1 moved -0.4 past clip 0.2: clipped value 0.3.
    # max((0.1 - 0)^2, (0.3 - 0)^2) = 0.09: the clipped term wins, loss 0.5 * 0.09 / 1 token =
    # 0.045, the one counted token clipped, and no gradient (the value is held at the bound).
    # Position 1 is not counted: its far-off value (moved 5, error 25) adds nothing to the loss
    # or the clip share
    values = torch.tensor([[0.1, 5.0]], requires_grad=True)
    old, ret = torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2)
    mask = torch.tensor([[True, False]])
    loss, stats = algorithm.value_loss(values, old, ret, mask, 0.2, 1)
    assert float(loss.detach()) == pytest.approx(0.045)
    assert float(stats["clip_frac"]) == pytest.approx(1.0)
    loss.backward()
    assert torch.equal(values.grad, torch.zeros(1, 2))


def test_ppo_advantages_fold_the_kl_and_whiten_over_the_tokens() -> None:
    algo = build_config({"algorithm": {"estimator": "ppo", "beta": 0.5, "lam": 1.0}}).algorithm
    assert algo.kl_estimator == "k1" and advantages.loss_beta(algo) == 0  # KL in the rewards
    # two completions of 2 tokens, rewards 1 and 0, values 0, log pi - log ref = 0.2 per token:
    # token rewards -0.1, 0.9 and -0.1, -0.1; lam 1, gamma 1: returns 0.8, 0.9 and -0.2, -0.1
    counted = torch.ones(2, 2, dtype=torch.bool)
    old, ref = torch.full((2, 2), -1.0), torch.full((2, 2), -1.2)
    adv, ret = advantages.critic_advantages(
        algo, torch.tensor([1.0, 0.0]), counted, old, ref, torch.zeros(2, 2)
    )
    assert torch.allclose(ret, torch.tensor([[0.8, 0.9], [-0.2, -0.1]]), atol=1e-6)
    # whitened: mean 0.35, population variance (0.45² + 0.55² + 0.55² + 0.45²) / 4 = 0.2525
    expected = (torch.tensor([[0.8, 0.9], [-0.2, -0.1]]) - 0.35) / (0.2525 + 1e-8) ** 0.5
    assert torch.allclose(adv, expected, atol=1e-5)
    stats = value_metrics(torch.zeros(2, 2), ret, counted)
    assert stats["value/mean"] == 0 and stats["value/explained_var"] == pytest.approx(0.0)


def test_ppo_advantages_with_beta_0_read_no_log_probs() -> None:
    # beta 0: no KL in the token rewards, whatever log-probs are given, even ones far enough
    # apart that k3's exp(ref - old) overflows float32 (0 * inf would be NaN): the advantages and
    # targets are those with no log-probs at all
    algo = build_config(
        {"algorithm": {"estimator": "ppo", "beta": 0.0, "kl_estimator": "k3", "lam": 1.0}}
    ).algorithm
    counted = torch.ones(2, 2, dtype=torch.bool)
    rewards, values = torch.tensor([1.0, 0.0]), torch.tensor([[0.2, 0.4], [0.1, 0.3]])
    old, ref = torch.full((2, 2), -100.0), torch.zeros(2, 2)
    adv, ret = advantages.critic_advantages(algo, rewards, counted, old, ref, values)
    plain_adv, plain_ret = advantages.critic_advantages(algo, rewards, counted, None, None, values)
    assert torch.isfinite(adv).all() and torch.equal(adv, plain_adv)
    assert torch.equal(ret, plain_ret)
    # gamma 1, lam 1: returns are the reward, 1 and 0, at every token
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


@pytest.mark.parametrize("attention", ["prefix", "dense"])
def test_packed_values_are_each_rows_own(
    tiny_model_dir: Path, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two groups of two completions behind left-padded prompts: the packed values equal those
    # of each row alone (its prompt and completion, unpadded, plain causal attention)
    config = build_config(
        {
            "model": {"name": str(tiny_model_dir), "precision": "float32"},
            "algorithm": {"estimator": "ppo"},
        }
    )
    policy = load_policy(config.model, config.model.name)
    model = value_model(config, policy)
    torch.nn.init.normal_(model.head.weight)
    if attention == "dense":
        model.body.set_attn_implementation("sdpa")
    prompts = [[5, 6, 7], [8, 9]]
    completions = [[10, 11, 12], [13], [14, 15], [16, 17, 18]]
    prompt_ids = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 8, 9], [0, 8, 9]])
    prompt_mask = prompt_ids != 0
    completion_ids = torch.tensor([c + [0] * (3 - len(c)) for c in completions])
    completion_mask = torch.tensor([[j < len(c) for j in range(3)] for c in completions])
    mb = MicroBatch(
        torch.arange(4),
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        completion_mask,
        torch.zeros(4),
        Decoding(),
    )
    with torch.no_grad():
        packed = completion_values(model, mb)
        for i, c in enumerate(completions):
            ids = torch.tensor([prompts[i // 2] + c])
            alone = model.head(model.body(input_ids=ids).last_hidden_state).squeeze(-1)[0]
            p = len(prompts[i // 2])
            assert torch.allclose(packed[i, : len(c)], alone[p - 1 : p - 1 + len(c)], atol=1e-5)
        # groups whose packing costs more than their rows (as the policy's scoring decides) and
        # a sliding window the sequences outgrow take one padded row per completion: same values
        with monkeypatch.context() as m:
            m.setattr(ScoringCost, "packing_pays", lambda *_: False)
            padded = completion_values(model, mb)
            assert torch.allclose(padded[completion_mask], packed[completion_mask], atol=1e-5)
        if attention == "prefix":
            # a body whose attention never reads the prefix layout would attend across the
            # packed completions: an error, not wrong values
            forward = model.body.forward
            model.body.forward = lambda **kw: forward(
                **{k: v for k, v in kw.items() if k != "prefix_layout"}
            )
            with pytest.raises(RuntimeError, match="does not pass keyword arguments"):
                completion_values(model, mb)


def test_ppo_refusals() -> None:
    with pytest.raises(ConfigError, match="estimator ppo has no groups"):
        build_config({"algorithm": {"estimator": "ppo", "reward_aggregation": "gdpo"}})


# ------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def tree(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {
        "model": {"name": str(tiny_model_dir), "precision": "float32"},
        "data": {"task": "arithmetic", "task_args": {"size": 32}},
        "rewards": {"functions": [{"name": TRAINABLE_REWARD}]},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "algorithm": {"estimator": "ppo", "beta": 0.05, "critic_lr": 1e-3, "num_iterations": 2},
        "optim": {"lr": 1e-2, "micro_batch_size": 4},
        "train": {
            "steps": 4,
            "save_every": 1,
            "threads": 1,
            "output_dir": str(tmp_path_factory.mktemp("runs")),
            "progress": False,
            "sinks": ["jsonl"],
        },
    }


def critic_of(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / f"step-{step}" / "trainer_state.pt")
    return state["critic"]["model"]


@pytest.fixture(scope="module")
def straight(tree: dict) -> Path:
    return train(build_config({**tree, "train": {**tree["train"], "run_name": "ppo"}}))


def test_ppo_trains_the_policy_and_the_critic(tree: dict, straight: Path, tiny_model_dir) -> None:
    logged = rows(straight)
    assert all("value/loss" in r and "value/explained_var" in r for r in logged)
    assert logged[0]["value/mean"] == 0  # the head starts at zero
    assert logged[-1]["value/mean"] > 0.05  # and learns the rewards' level (about 0.3)
    start, end = (
        load_file(tiny_model_dir / "model.safetensors"),
        load_file(straight / "final" / "model.safetensors"),
    )
    assert max(float((end[k] - start[k]).abs().max()) for k in end) > 1e-2  # the policy moved
    # the critic's head left zero, and its body (a copy of the policy's decoder) moved
    critic = critic_of(straight, 4)
    assert float(critic["head.weight"].abs().max()) > 0
    name = "layers.0.self_attn.q_proj.weight"
    assert not torch.equal(critic[f"body.{name}"], start[f"model.{name}"])
    assert not torch.equal(critic[f"body.{name}"], end[f"model.{name}"])
    trainer = Trainer(build_config({**tree, "train": {**tree["train"], "run_name": "x"}}))
    assert trainer.state.critic is not None and trainer.update.critic is trainer.state.critic
    trainer.run.release()


KILL_AT_UPDATE = Path(__file__).parents[1] / "integration" / "kill_at_update.py"


def test_kill_9_and_resume_end_with_the_same_policy_and_critic(tree: dict, straight: Path) -> None:
    config = build_config({**tree, "train": {**tree["train"], "run_name": "ppo-killed"}})
    life = subprocess.run(
        [sys.executable, str(KILL_AT_UPDATE), config.model_dump_json(), "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert life.returncode == -signal.SIGKILL, life.stderr[-2000:]
    resumed = train(
        build_config(
            {**tree, "train": {**tree["train"], "run_name": "ppo-killed", "resume": "auto"}}
        )
    )
    assert rows(resumed) == rows(straight)
    a, b = critic_of(straight, 4), critic_of(resumed, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    wa = load_file(straight / "final" / "model.safetensors")
    wb = load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_non_finite_critic_gradient_takes_no_step_and_says_so(
    tiny_model_dir: Path, capsys
) -> None:
    config = build_config(
        {
            "model": {"name": str(tiny_model_dir), "precision": "float32"},
            "algorithm": {"estimator": "ppo"},
        }
    )
    critic = Critic(config, load_policy(config.model, config.model.name), torch.device("cpu"))
    before = {k: v.clone() for k, v in critic.model.state_dict().items()}
    ids = torch.tensor([[5, 6, 7]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    mb = MicroBatch(torch.arange(1), ids, mask, ids, mask, mask, torch.zeros(1), Decoding())
    nan = torch.full((1, 3), float("nan"))
    stats = critic.update([mb], nan, torch.zeros(1, 3), mask, step=7, announce=True)
    assert stats["value/grad_norm"] != stats["value/grad_norm"]  # NaN
    after = critic.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "step 7: the critic's gradient norm is nan (not finite)" in capsys.readouterr().err
