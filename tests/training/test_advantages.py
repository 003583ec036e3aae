"""The estimators and the reward aggregation through the trainer (``grpo.training.advantages``):
the advantages it scores and trains on are the formulas', and each choice changes the update."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import grpo.training.trainer
import grpo.training.update
from grpo import algorithm
from grpo.config import Config, build_config
from grpo.step_data import Rollout
from grpo.training import advantages
from grpo.training.trainer import Trainer

TOY = Path(__file__).resolve().parents[1] / "toy_rewards.py"
# two functions that both vary within groups of the random model's completions
REWARDS = {
    "functions": [
        {"name": f"{TOY}:lowercase_share"},
        {"name": f"{TOY}:hashed_pass", "weight": 0.5},
    ]
}


@pytest.fixture(scope="module")
def make(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Tiny configs: two rewards, beta 0.1, lr 1e-2, one micro-batch of 4 and one of 4."""
    output_dir = tmp_path_factory.mktemp("advantages")

    def config(**algo) -> Config:
        return build_config(
            {
                "model": {"name": str(tiny_model_dir), "precision": "float32"},
                "data": {"task": "arithmetic", "task_args": {"size": 64}},
                "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
                "rewards": REWARDS,
                "algorithm": {"beta": 0.1, **algo},
                "optim": {"lr": 1e-2, "micro_batch_size": 4},
                "train": {"output_dir": str(output_dir), "progress": False, "sinks": ["jsonl"]},
            }
        )

    return config


@pytest.fixture(scope="module")
def rollout(make) -> Rollout:
    """One rollout of 2 prompts x 4 from the start weights, shared by the tests below."""
    return Trainer(make()).producer.rollout()


def spy(monkeypatch, module, name: str) -> list[dict]:
    """Record each call of module.name: its arguments by name and its result."""
    original = getattr(module, name)
    signature = inspect.signature(original)
    calls: list[dict] = []

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append({**signature.bind(*args, **kwargs).arguments, "result": result})
        return result

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize(
    "algo",
    [{}, {"estimator": "rloo"}, {"reward_aggregation": "gdpo"}, {"estimator": "reinforce_pp"}],
    ids=["grpo", "rloo", "gdpo", "reinforce_pp"],
)
def test_scored_advantages_are_the_estimators(make, rollout, algo: dict) -> None:
    trainer = Trainer(make(**algo))
    scored = trainer.producer.score(rollout)
    r, scores = scored.rewards, scored.per_function  # [8], [8, 2]
    assert float(r.view(2, 4).std(dim=1).min()) > 1e-3  # every group's rewards vary
    weights = torch.tensor([1.0, 0.5])
    expected = {
        "grpo": algorithm.group_advantages(r, 4),
        "rloo": algorithm.leave_one_out_advantages(r, 4),  # resolved: no std scale
        "gdpo": algorithm.decoupled_advantages(scores, weights, 4),
        # without the KL: the rewards normalised over the tokens, each completion its length
        "reinforce_pp": algorithm.batch_normalize(r, rollout.loss_mask.sum(dim=1)),
    }[algo.get("estimator", "gdpo" if algo else "grpo")]
    assert torch.allclose(scored.advantages, expected, atol=1e-6)
    if algo:  # and they are not GRPO's
        grpo = algorithm.group_advantages(r, 4)
        assert float((scored.advantages - grpo).abs().max()) > 1e-3


@pytest.mark.parametrize(
    "algo",
    [{}, {"reward_aggregation": "gdpo"}, {"estimator": "reinforce_pp"}],
    ids=["grpo", "gdpo", "reinforce_pp"],
)
def test_recomputed_advantages_are_the_scored_ones(make, rollout, algo: dict) -> None:
    # dynamic sampling recomputes the advantages of the groups it keeps: from the same rewards,
    # per-function scores, weights and token counts as scoring, so the same values (GDPO reads
    # the per-function scores and weights, REINFORCE++ the completions' lengths)
    trainer = Trainer(make(**algo))
    scored = trainer.producer.score(rollout)
    again = trainer.producer.recomputed_advantages(scored)
    assert torch.allclose(again, scored.advantages, atol=1e-6)
    if algo:
        grpo = algorithm.group_advantages(scored.rewards, 4)
        assert float((again - grpo).abs().max()) > 1e-3


def test_reinforce_pp_trains_on_per_token_advantages_with_no_kl_in_the_loss(
    make, rollout, monkeypatch
) -> None:
    # beta 0.1: the sampling policy's k1 KL to the reference shapes every token's reward, so
    # the loss gets [b, T'] advantages (the formula's over the whole batch, each micro-batch its
    # rows) and no KL term; the KL is still measured and logged
    trainer = Trainer(make(estimator="reinforce_pp"))
    with torch.no_grad():  # a policy away from the reference: the KL is not 0
        for p in trainer.state.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    scored = trainer.producer.score(rollout)
    frozen = spy(monkeypatch, trainer.update, "frozen_logprobs")
    cuts = spy(monkeypatch, grpo.training.update, "micro_batches")
    losses = spy(monkeypatch, algorithm, "policy_loss")
    metrics = trainer.optimize(scored)
    ((ref, old),) = [c["result"] for c in frozen]
    assert old is not None  # mu 1, yet the KL needs the sampling policy's log-probs first
    counted = rollout.loss_mask
    kl = old - ref  # k1, the estimator reinforce_pp resolves to
    assert float(kl[counted].abs().max()) > 1e-3
    want = algorithm.reinforce_pp_advantages(scored.rewards, counted, kl, beta=0.1)
    (cut,) = cuts
    got = torch.zeros_like(want)
    for mb, call in zip(cut["result"], losses, strict=True):
        assert call["knobs"].beta == 0.0 and call["ref_logp"] is not None
        assert call["advantages"].shape == call["logp"].shape
        got[mb.index, : call["advantages"].shape[1]] = call["advantages"]
    assert len(losses) == 2
    assert torch.allclose(got, want, atol=1e-6)
    row = want[0][counted[0]]  # the KL made one completion's tokens differ
    assert float(row.max() - row.min()) > 1e-4
    assert abs(metrics["kl"]) > 1e-4


def test_token_advantages_are_none_unless_the_kl_is_in_the_rewards(make) -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp = torch.zeros(2, 3)
    grpo = make().algorithm
    assert advantages.token_advantages(grpo, torch.ones(2), mask, logp, logp) is None
    beta0 = make(estimator="reinforce_pp", beta=0.0).algorithm
    assert advantages.token_advantages(beta0, torch.ones(2), mask, None, None) is None
    assert not advantages.needs_old_logprobs(beta0) and advantages.loss_beta(beta0) == 0.0
    assert advantages.loss_beta(grpo) == 0.1 and not advantages.needs_old_logprobs(grpo)


CHANGES = [
    {"estimator": "rloo"},
    {"estimator": "reinforce_pp"},
    {"estimator": "reinforce_pp", "beta": 0.0},
    {"reward_aggregation": "gdpo"},
    {"reward_aggregation": "gdpo", "estimator": "rloo"},
]


def update(make, rollout: Rollout, algo: dict) -> dict[str, torch.Tensor]:
    trainer = Trainer(make(**algo))
    trainer.optimize(trainer.producer.score(rollout))
    return {k: v.detach().clone() for k, v in trainer.state.policy.state_dict().items()}


@pytest.fixture(scope="module")
def baseline(make, rollout) -> dict[str, torch.Tensor]:
    return update(make, rollout, {})


@pytest.mark.parametrize("algo", CHANGES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_each_estimator_moves_the_weights_and_changes_the_update(
    make, rollout, baseline, weights, algo: dict
) -> None:
    start = Trainer(make()).state.policy
    after = update(make, rollout, algo)
    weights.assert_moved(weights.of(start), after)
    weights.assert_moved(baseline, after, atol=1e-6)


def test_gdpo_advantages_use_the_configs_eps(make, rollout) -> None:
    # adv_eps reaches GDPO's normalisations too: a large one shrinks every advantage
    trainer = Trainer(make(reward_aggregation="gdpo", adv_eps=1.0))
    scored = trainer.producer.score(rollout)
    weights = torch.tensor([1.0, 0.5])
    want = algorithm.decoupled_advantages(scored.per_function, weights, 4, eps=1.0)
    assert torch.allclose(scored.advantages, want, atol=1e-6)
    default = algorithm.decoupled_advantages(scored.per_function, weights, 4)
    assert float((want - default).abs().max()) > 1e-3


def test_per_token_advantages_need_both_sides_of_the_kl(make) -> None:
    # reinforce_pp folds KL(old || ref) into the rewards: with either side missing (beta 0 and
    # mu > 1 give the old log-probs alone) there is no KL, and the [N] advantages hold
    algo = make(estimator="reinforce_pp").algorithm
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp = torch.zeros(2, 3)
    assert advantages.token_advantages(algo, torch.ones(2), mask, logp, None) is None
    assert advantages.token_advantages(algo, torch.ones(2), mask, None, logp) is None


def test_every_batch_normalisation_takes_the_configs_eps(make) -> None:
    # rewards 0.1 apart: a batch's variance is far under adv_eps 1.0, which shrinks every
    # advantage against the default 1e-8: batch (reinforce_pp's [N]), per-token (its KL in
    # the rewards) and the critic's GAE each normalise with the config's eps
    rewards = torch.tensor([0.0, 0.1])
    counted = torch.tensor([[True, True, False], [True, True, True]])
    old, ref = torch.zeros(2, 3), torch.full((2, 3), -0.01)
    values = torch.tensor([[0.03, 0.01, 0.0], [0.0, 0.02, 0.04]])
    largest = {}
    for eps in (1e-8, 1.0):
        algo = make(estimator="reinforce_pp", adv_eps=eps).algorithm
        batch = advantages.batch_advantages(
            algo, 2, rewards, rewards[:, None], torch.ones(1), counted.sum(1)
        )
        per_token = advantages.token_advantages(algo, rewards, counted, old, ref)
        want = algorithm.reinforce_pp_advantages(rewards, counted, -(ref - old), 0.1, eps)
        assert torch.allclose(per_token, want, atol=1e-6)
        ppo = make(estimator="ppo", adv_eps=eps, beta=0.0).algorithm
        critic, _ = advantages.critic_advantages(ppo, rewards, counted, None, None, values)
        largest[eps] = [float(a.abs().max()) for a in (batch, per_token, critic)]
    assert all(big > 0.5 for big in largest[1e-8])
    assert all(s < 0.2 * b for s, b in zip(largest[1.0], largest[1e-8], strict=True))


def test_critic_advantages_are_whitened_over_counted_tokens_alone(make) -> None:
    # the GAE advantages of the counted tokens have mean 0 and variance 1 after whitening;
    # a position outside the loss (after a completion's end) neither counts nor gets one
    ppo = make(estimator="ppo", beta=0.0).algorithm
    rewards = torch.tensor([1.0, 0.0, 0.5])
    counted = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
    values = torch.tensor([[0.2, 0.0, 0.0], [0.1, 0.3, 0.0], [0.4, 0.2, 0.1]])
    got, _ = advantages.critic_advantages(ppo, rewards, counted, None, None, values)
    kept = got[counted].double()
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(kept.var(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(got[~counted], torch.zeros(int((~counted).sum())))
