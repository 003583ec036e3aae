"""Every config field that changes the algorithm or sampling reaches the math, through the trainer.

Three kinds of checks, all on the tiny model with the trainable reward:
- a spy on the math functions' arguments: the trainer passes what the config says;
- an oracle: every loss the trainer computes (all micro-batches, all ``num_iterations`` passes)
  and the logged step loss equal a slow loop written here from the config and the rollout;
- end to end: turning a knob changes the update (and the sampler samples what the scorer scores).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path

import pytest
import torch

import grpo.training.advantages
import grpo.training.trainer
import grpo.training.update
from grpo import algorithm
from grpo.config import Config, build_config
from grpo.rollout import decode_completions, decoding_of
from grpo.scoring.logprobs import completion_logprobs as original_logprobs
from grpo.step_data import Rollout, Scored
from grpo.training.trainer import Trainer

MAX_NEW = 12


@pytest.fixture(scope="module")
def knob_config(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, trainable_reward):
    """A factory of tiny configs: the trainable reward only, beta 0 unless set, lr 1e-2."""
    output_dir = tmp_path_factory.mktemp("knobs")

    def make(**sections: dict) -> Config:
        tree: dict = {
            "model": {"name": str(tiny_model_dir), "precision": "float32"},
            "data": {"task": "arithmetic", "task_args": {"size": 64}},
            "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": MAX_NEW},
            "rewards": trainable_reward,
            "algorithm": {"beta": 0.0},
            "optim": {"lr": 1e-2, "micro_batch_size": 8},
            "train": {"output_dir": str(output_dir), "progress": False, "sinks": ["jsonl"]},
        }
        for key, value in sections.items():
            tree[key] = {**tree.get(key, {}), **value}
        return build_config(tree)

    return make


@pytest.fixture(scope="module")
def rollout(knob_config) -> Rollout:
    """One rollout of 2 prompts x 4, cut to lengths 1 + 5i mod 12 (the random model rarely
    stops by itself), so the aggregations differ; rows cut at the limit are the truncated ones.
    Shared by the tests below, which score and train on it from the same start weights."""
    trainer = Trainer(knob_config())
    full = trainer.producer.rollout()
    lengths = torch.tensor([1 + (5 * i) % MAX_NEW for i in range(full.num_completions)])
    mask = torch.arange(full.completion_ids.shape[1])[None, :] < lengths[:, None]
    ids = full.completion_ids.masked_fill(~mask, trainer.tokenizer.pad_token_id)
    return dataclasses.replace(
        full,
        completion_ids=ids,
        completion_mask=mask,
        truncated=lengths == MAX_NEW,
        completions=decode_completions(trainer.tokenizer, ids, mask),
    )


def scored_by(trainer: Trainer, rollout: Rollout) -> Scored:
    scored = trainer.producer.score(rollout)
    assert scored.advantages.abs().min() > 0 and bool(rollout.truncated.any())
    return scored


# --------------------------------------------------------------------------------------- spies


def spy_on(monkeypatch, module, name: str) -> list[dict]:
    """Replace module.name by a wrapper recording each call's arguments by name (defaults filled
    in) and its result."""
    original = getattr(module, name)
    signature = inspect.signature(original)
    calls: list[dict] = []

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        result = original(*args, **kwargs)
        calls.append({**bound.arguments, "result": result})
        return result

    monkeypatch.setattr(module, name, wrapper)
    return calls


SHARED_KNOBS = {  # every algorithm knob off its default, each to a value no other knob has
    "clip_low": 0.1,
    "clip_high": 0.28,
    "beta": 0.3,
    "kl_estimator": "k2",
    "ratio_level": "sequence",
}
# the knobs one loss type reads (a recipe that sets them for another is refused)
LOSS_KNOBS = {
    "dapo": {"loss_type": "dapo", "dual_clip": 3.0},
    "cispo": {"loss_type": "cispo", "cispo_clip_low": 0.5, "cispo_clip_high": 2.5},
    "sapo": {"loss_type": "sapo", "sapo_tau_pos": 1.5, "sapo_tau_neg": 2.0},
}


@pytest.mark.parametrize("loss", LOSS_KNOBS)
def test_the_trainer_passes_each_knob_to_the_math(
    knob_config, rollout, monkeypatch, loss: str
) -> None:
    knobs = {**SHARED_KNOBS, **LOSS_KNOBS[loss]}
    config = knob_config(
        algorithm={**knobs, "top_entropy_quantile": 0.5, "num_iterations": 2},
        rollout={"temperature": 0.7},
        optim={"micro_batch_size": 4},
    )
    trainer = Trainer(config)
    # the shared rollout was sampled at T 1; mark it as the engine would have at this config
    rollout = dataclasses.replace(rollout, decoding=decoding_of(config.rollout))
    scored = scored_by(trainer, rollout)
    losses = spy_on(monkeypatch, algorithm, "policy_loss")
    entropy = spy_on(monkeypatch, algorithm, "top_entropy_mask")
    logprobs = spy_on(monkeypatch, grpo.training.update, "completion_logprobs")
    metrics = trainer.optimize(scored)
    assert len(losses) == 2 * 2  # num_iterations x micro-batches
    for call in losses:
        for knob, value in knobs.items():
            assert getattr(call["knobs"], knob) == value, knob
        assert call["ref_logp"] is not None and call["pg_mask"] is not None
    assert [c["quantile"] for c in entropy] == [0.5, 0.5]  # once per micro-batch, first pass
    # the logged share of counted tokens the filter kept: the masks' tokens over the counted
    kept = sum(float(c["result"].sum()) for c in entropy)
    counted = sum(float(c["loss_mask"].sum()) for c in entropy)
    assert 0 < kept < counted and metrics["entropy/kept_frac"] == pytest.approx(kept / counted)
    # reference and old log-probs (mu 2), then each pass's gradient forwards: all at T 0.7
    assert len(logprobs) == 2 + 2 + 2 * 2
    assert {c["decoding"].temperature for c in logprobs} == {0.7}


def test_quantile_one_filters_no_token_and_the_engine_gets_the_update(
    knob_config, rollout, monkeypatch
) -> None:
    # top_entropy_quantile 1 (the default) is the filter off: no mask, no kept-fraction metric;
    # after the update the engine is handed the policy (vLLM copies its weights from it)
    trainer = Trainer(knob_config())
    scored = scored_by(trainer, rollout)
    losses = spy_on(monkeypatch, algorithm, "policy_loss")
    entropy = spy_on(monkeypatch, algorithm, "top_entropy_mask")
    metrics = trainer.optimize(scored)
    assert entropy == [] and losses and all(c["pg_mask"] is None for c in losses)
    assert "entropy/kept_frac" not in metrics and "entropy" in metrics
    # a whole step hands the engine the updated policy; a step that changed nothing does not
    synced = spy_on(monkeypatch, trainer.producer.engine, "sync_weights")
    trainer.state.step = 1
    trainer.train_step()
    assert [c["model"] for c in synced] == [trainer.state.policy]
    trainer.producer.sync_weights(2, changed=False)
    assert len(synced) == 1


def test_the_entropy_bonus_is_in_every_passs_loss_and_only_it_asks_entropy_after_the_first(
    knob_config, rollout, monkeypatch
) -> None:
    # dapo averages the counted tokens, as the logged entropy does: the first pass's loss loses
    # exactly coef x entropy. Entropy is asked of the old log-probs' forward never, of the first
    # pass always (it is logged), of the second only when a bonus needs it
    logprobs = spy_on(monkeypatch, grpo.training.update, "completion_logprobs")
    runs = {}
    for coef in (0.0, 0.3):
        algo = {"loss_type": "dapo", "num_iterations": 2, "entropy_coef": coef}
        trainer = Trainer(knob_config(algorithm=algo))
        scored = scored_by(trainer, rollout)
        logprobs.clear()
        runs[coef] = trainer.optimize(scored)
        assert [c["with_entropy"] for c in logprobs] == [False, True, coef > 0]
    plain, bonus = runs[0.0], runs[0.3]
    assert plain["entropy"] > 1.0  # the random model is far from deterministic
    assert bonus["loss"] == pytest.approx(plain["loss"] - 0.3 * plain["entropy"], abs=1e-5)


def test_ppo_folds_a_moved_policys_kl_into_the_critics_targets(knob_config, rollout) -> None:
    # a policy moved off its reference (the same noise in both runs): with beta > 0 the token
    # rewards lose beta x KL(old || ref), so the critic's value loss against its targets differs
    # from beta 0's, from the same critic start (the same values)
    runs = {}
    for beta in (0.0, 0.5):
        trainer = Trainer(knob_config(algorithm={"estimator": "ppo", "beta": beta}))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in trainer.state.policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        runs[beta] = trainer.optimize(trainer.producer.score(rollout))
    plain, folded = runs[0.0], runs[0.5]
    assert folded["value/mean"] == plain["value/mean"]
    assert abs(folded["value/loss"] - plain["value/loss"]) > 0.1 * plain["value/loss"]


def test_max_grad_norm_clips_the_gradient_the_optimizer_steps_on(knob_config, rollout) -> None:
    # AdamW's first step is near scale-free, but its first moment is (1 - beta1) x the gradient
    # it was given: after one step its global norm is (1 - beta1) x max_grad_norm when the
    # logged (unclipped) norm is above it
    trainer = Trainer(knob_config(optim={"max_grad_norm": 0.05}))
    metrics = trainer.optimize(scored_by(trainer, rollout))
    assert metrics["grad_norm"] > 0.5
    beta1 = trainer.state.optimizer.param_groups[0]["betas"][0]
    moments = [state["exp_avg"] for state in trainer.state.optimizer.state.values()]
    norm = math.sqrt(sum(float(m.double().pow(2).sum()) for m in moments))
    assert norm == pytest.approx((1 - beta1) * 0.05, rel=1e-4)


def test_a_non_finite_critic_gradient_is_announced_with_its_step(
    knob_config, rollout, capsys
) -> None:
    # a critic whose values are NaN has a NaN gradient: it takes no step, and the warning line
    # names the step the trainer is at, as the policy's does
    trainer = Trainer(knob_config(algorithm={"estimator": "ppo"}))
    scored = trainer.producer.score(rollout)
    with torch.no_grad():
        trainer.state.critic.model.head.bias.fill_(math.nan)
    trainer.state.step = 3
    capsys.readouterr()
    metrics = trainer.optimize(scored)
    assert not math.isfinite(metrics["value/grad_norm"])
    err = capsys.readouterr().err
    assert "grpo: warning: step 3: the critic's gradient norm is nan" in err


def test_dynamic_sampling_recomputes_advantages_with_the_configured_eps(
    knob_config, monkeypatch
) -> None:
    # the kept groups' advantages are recomputed over the kept batch with algorithm.adv_eps, as
    # each round's are (a large eps shrinks every advantage, so it shows in the values)
    config = knob_config(algorithm={"adv_eps": 0.5}, sampling={"dynamic": True, "max_rounds": 2})
    trainer = Trainer(config)
    calls = spy_on(monkeypatch, grpo.training.advantages, "batch_advantages")
    batch = trainer.producer.collect(1).collected
    assert batch.train is not None and len(calls) >= 2  # each round's, then the kept batch's
    assert [c["algo"].adv_eps for c in calls] == [0.5] * len(calls)
    r = batch.train.rewards.double().view(-1, 4)
    centred = r - r.mean(dim=1, keepdim=True)
    expected = centred / (centred.pow(2).mean(dim=1, keepdim=True) + 0.5).sqrt()
    assert torch.allclose(batch.train.advantages, expected.flatten().float(), atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_gives_the_advantages_of_its_formula(
    knob_config, rollout, scale: str
) -> None:
    trainer = Trainer(knob_config(algorithm={"scale_rewards": scale, "adv_eps": 1e-4}))
    scored = trainer.producer.score(rollout)
    r = scored.rewards.double().view(-1, 4)  # [P, G]
    centred = r - r.mean(dim=1, keepdim=True)
    denom = {
        "group": (centred.pow(2).mean(dim=1, keepdim=True) + 1e-4).sqrt(),
        "batch": ((r - r.mean()).pow(2).mean() + 1e-4).sqrt(),
        "none": torch.tensor(1.0, dtype=torch.float64),
    }[scale]
    expected = (centred / denom).flatten().float()
    assert torch.allclose(scored.advantages, expected, atol=1e-6)
    assert float(centred.abs().max()) > 1e-3  # the rewards really vary within groups


# --------------------------------------------------------------------------------------- oracle


def slow_loss(call: dict, cfg, rows: list[int], scored: Scored, n_micro: int) -> float:
    """The loss of one micro-batch by a loop over rows and tokens, from the config and the
    rollout (not from the normaliser the trainer passed)."""
    rollout = scored.rollout
    a = cfg.algorithm
    logp, old, ref = call["logp"].detach(), call["old_logp"], call["ref_logp"]
    weights, pg_mask = call["importance_weights"], call["pg_mask"]
    keep = (
        ~rollout.truncated if a.mask_truncated_completions else torch.ones_like(rollout.truncated)
    )
    step_tokens = float((rollout.completion_mask & keep[:, None]).sum())
    total, batch_tokens = 0.0, 0.0
    for i, row in enumerate(rows):
        n = int(rollout.completion_mask[row].sum()) if keep[row] else 0
        adv = float(scored.advantages[row])
        seq_ratio = math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(n)) / max(n, 1))
        row_sum = 0.0
        for t in range(n):
            ratio = seq_ratio if a.ratio_level == "sequence" else math.exp(logp[i, t] - old[i, t])
            if a.loss_type == "cispo":  # -sg(clip(ratio)) * A * logp
                low = 0.0 if a.cispo_clip_low is None else 1 - a.cispo_clip_low
                term = -min(max(ratio, low), 1 + a.cispo_clip_high) * adv * float(logp[i, t])
            elif a.loss_type == "sapo":  # -sigmoid(tau (ratio - 1)) * 4 / tau * A
                tau = a.sapo_tau_pos if adv > 0 else a.sapo_tau_neg
                term = -4 / tau / (1 + math.exp(-tau * (ratio - 1))) * adv
            else:
                clipped = min(max(ratio, 1 - a.clip_low), 1 + a.clip_high)
                term = -min(ratio * adv, clipped * adv)
            if a.dual_clip is not None and adv < 0:
                term = min(term, -a.dual_clip * adv)
            if weights is not None:
                term *= float(weights[i, t])
            if pg_mask is not None and not pg_mask[i, t]:
                term = 0.0
            if ref is not None:
                d = float(ref[i, t] - logp[i, t])  # log(ref / pi)
                kl = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[a.kl_estimator]
                term += a.beta * kl
            row_sum += term
        total += row_sum / max(n, 1) if a.loss_type in ("grpo", "sapo") else row_sum
        batch_tokens += n
    n_seq = rollout.num_completions
    return {
        "grpo": total / n_seq,
        "bnpo": total / max(batch_tokens, 1) / n_micro,
        "dapo": total / step_tokens,
        "dr_grpo": total / (n_seq * cfg.rollout.max_new_tokens),
        "cispo": total / step_tokens,
        "sapo": total / n_seq,
    }[a.loss_type]


@pytest.mark.parametrize(
    "algo",
    [
        {"loss_type": "grpo", "clip_low": 0.002, "clip_high": 0.003, "top_entropy_quantile": 0.5},
        {
            "loss_type": "bnpo",
            "mask_truncated_completions": True,
            "dual_clip": 1.001,
            "clip_low": 0.5,
        },
        {"loss_type": "dapo", "ratio_level": "sequence", "clip_high": 0.002, "kl_estimator": "k2"},
        {"loss_type": "dr_grpo", "mask_truncated_completions": True, "kl_estimator": "k1"},
        {
            "loss_type": "cispo",
            "cispo_clip_low": 0.001,
            "cispo_clip_high": 0.002,
            "top_entropy_quantile": 0.5,
        },
        {
            "loss_type": "sapo",
            "sapo_tau_pos": 30.0,
            "sapo_tau_neg": 60.0,
            "ratio_level": "sequence",
            "mask_truncated_completions": True,
        },
    ],
    ids=[
        "grpo-clip-entropy",
        "bnpo-masked-dual",
        "dapo-gspo-k2",
        "drgrpo-masked-k1",
        "cispo-clip-entropy",
        "sapo-gspo-masked",
    ],
)
def test_every_loss_the_trainer_computes_is_the_formula(
    knob_config, rollout, monkeypatch, weights, algo: dict
) -> None:
    # two passes (mu 2) over three micro-batches with a reference (beta 0.5): the second pass
    # sees ratios != 1 and a KL > 0, so clipping, ratio level and the estimator all count
    config = knob_config(
        algorithm={"num_iterations": 2, "beta": 0.5, **algo}, optim={"micro_batch_size": 3}
    )
    trainer = Trainer(config)
    scored = scored_by(trainer, rollout)
    batches = spy_on(monkeypatch, grpo.training.update, "micro_batches")
    calls = spy_on(monkeypatch, algorithm, "policy_loss")
    start = weights.of(trainer.state.policy)
    metrics = trainer.optimize(scored)
    weights.assert_moved(start, weights.of(trainer.state.policy))

    (split,) = batches
    mbs = split["result"]
    assert len(mbs) == 3 and len(calls) == 2 * len(mbs)
    for k, call in enumerate(calls):
        rows = mbs[k % len(mbs)].index.tolist()
        expected = slow_loss(call, config, rows, scored, len(mbs))
        assert float(call["result"][0].detach()) == pytest.approx(expected, rel=1e-4, abs=1e-6), k
    last = calls[-1]
    assert float((last["logp"] - last["old_logp"])[last["loss_mask"]].abs().max()) > 1e-3
    assert float(last["result"][1]["kl"]) > 1e-6
    # the logged loss is the first pass's sum over micro-batches: the step's loss
    first = sum(float(c["result"][0].detach()) for c in calls[: len(mbs)])
    assert metrics["loss"] == pytest.approx(first, rel=1e-5, abs=1e-7)


def test_micro_batch_size_does_not_change_the_step(knob_config, rollout) -> None:
    # the loss is normalised by the step's counts, never the micro-batch's: one micro-batch
    # of 8 and micro-batches of 3 give the same loss and gradient (bnpo, a mean of
    # micro-batch means by definition, is checked against that definition above)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        runs = []
        for size in (8, 3):
            config = knob_config(
                algorithm={"loss_type": loss_type}, optim={"micro_batch_size": size}
            )
            trainer = Trainer(config)
            runs.append(trainer.optimize(scored_by(trainer, rollout)))
        one, three = runs
        assert one["grad_norm"] > 0.01
        for key in ("loss", "grad_norm"):
            assert three[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), (loss_type, key)


# --------------------------------------------------------------------------------- end to end


CHANGES = [
    {"loss_type": "dapo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "cispo"},
    {"loss_type": "sapo"},
    {"scale_rewards": "none"},
    {"clip_low": 0.001},
    {"clip_high": 0.001},
    {"dual_clip": 1.001, "clip_low": 0.9},
    {"ratio_level": "sequence"},
    {"mask_truncated_completions": True},
    {"top_entropy_quantile": 0.3},
    {"num_iterations": 1},
    {"beta": 0.0},
    {"kl_estimator": "k2"},
]


def update(knob_config, rollout: Rollout, changes: dict) -> dict:
    """Weights after one update (mu 2, beta 0.5 unless changed) on the shared rollout."""
    trainer = Trainer(knob_config(algorithm={"num_iterations": 2, "beta": 0.5, **changes}))
    trainer.optimize(scored_by(trainer, rollout))
    return {k: v.detach().clone() for k, v in trainer.state.policy.state_dict().items()}


@pytest.fixture(scope="module")
def baseline(knob_config, rollout) -> dict:
    return update(knob_config, rollout, {})


@pytest.mark.parametrize(
    "changes", CHANGES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_each_knob_changes_the_update(knob_config, rollout, baseline, weights, changes) -> None:
    # the same scored rollout from the same start weights; mu 2 and beta 0.5, so clipping, the
    # ratio level and the KL term all act on the second pass: a knob that never reaches the
    # math leaves the weights equal to the baseline's
    weights.assert_moved(baseline, update(knob_config, rollout, changes), atol=1e-6)


@pytest.fixture(scope="module")
def sampled_rollout(knob_config, rollout) -> Rollout:
    """The shared rollout as an engine that reports its own log-probs would return it: the
    start policy's log-probs plus seeded noise (std 0.3 per token), so that importance weights
    and the behaviour-to-current divergence differ from 1 and 0 token by token."""
    policy = Trainer(knob_config()).state.policy
    r = rollout
    with torch.no_grad():
        logp, _ = original_logprobs(
            policy, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 1.0
        )
    noise = 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    return dataclasses.replace(r, sampler_logp=(logp + noise).masked_fill(~r.completion_mask, 0))


# (base, change): the change on top of the base moves the weights away from the base's update
KNOB_PAIRS = [
    ({"loss_type": "cispo"}, {"cispo_clip_high": 0.001}),
    ({"loss_type": "cispo"}, {"cispo_clip_low": 0.001}),
    ({"loss_type": "sapo"}, {"sapo_tau_pos": 50.0}),
    ({"loss_type": "sapo"}, {"sapo_tau_neg": 50.0}),
    ({}, {"tis_cap": 1.05}),
    ({"tis_cap": 1.05}, {"tis_level": "sequence"}),
    ({"tis_cap": 1.05}, {"tis_mode": "mask"}),
    ({"tis_cap": 1.05, "tis_mode": "mask"}, {"tis_low": 0.95}),
    ({}, {"offpolicy_mask_delta": 0.0}),
]


@pytest.mark.parametrize(
    ("base", "change"),
    KNOB_PAIRS,
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults",
)
def test_each_loss_and_correction_knob_changes_the_update(
    knob_config, sampled_rollout, weights, base: dict, change: dict
) -> None:
    # as above, on a rollout with sampler log-probs (the corrections act only with them)
    before = update(knob_config, sampled_rollout, base)
    weights.assert_moved(before, update(knob_config, sampled_rollout, {**base, **change}), 1e-6)


# -------------------------------------------------------------------------------- temperature


def peaked(trainer: Trainer, factor: float = 4.0) -> None:
    """Scale the final norm so the random model's next-token distribution is far from uniform."""
    with torch.no_grad():
        trainer.state.policy.model.norm.weight.mul_(factor)


def first_token_frequencies(trainer: Trainer, monkeypatch) -> tuple[dict, dict, dict]:
    """Sample G one-token completions of one prompt through the trainer's engine (the rollout
    the trainer trains on). Returns the empirical frequency of each token drawn, the
    probability the trainer's scorer gave it, and its probability at temperature 1."""
    scored = trainer.producer.score(trainer.producer.rollout())
    r = scored.rollout
    with torch.no_grad():  # before the update moves the weights
        plain, _ = original_logprobs(
            trainer.state.policy,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            1.0,
        )
    calls = spy_on(monkeypatch, grpo.training.update, "completion_logprobs")
    trainer.optimize(scored)  # beta 0, one iteration: the gradient pass is the only scoring
    (call,) = calls
    ids = call["completion_ids"][:, 0]
    logp = call["result"][0][:, 0].detach()
    counts = torch.bincount(ids).tolist()
    freq = {tok: c / len(ids) for tok, c in enumerate(counts) if c}
    prob = {int(tok): math.exp(float(lp)) for tok, lp in zip(ids, logp, strict=True)}
    prob_one = {
        int(tok): math.exp(float(lp))
        for tok, lp in zip(r.completion_ids[:, 0], plain[:, 0], strict=True)
    }
    return freq, prob, prob_one


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.6])
def test_sampler_and_scorer_use_the_same_temperature(
    knob_config, monkeypatch, temperature: float
) -> None:
    # 400 one-token samples of one prompt: the frequency of each token must match the
    # probability the trainer's log-probs give it (one std of a frequency is <= 0.025). The
    # peaked model's top token has p = 0.36 at T 1, 0.96 at T 0.5 and 0.11 at T 1.6, so a
    # sampler or a scorer that ignored the temperature is off by more than 0.2.
    config = knob_config(
        rollout={
            "prompts_per_step": 1,
            "group_size": 400,
            "max_new_tokens": 1,
            "temperature": temperature,
        },
        optim={"micro_batch_size": 400},
    )
    trainer = Trainer(config)
    peaked(trainer)
    freq, prob, prob_one = first_token_frequencies(trainer, monkeypatch)
    for tok, p in prob.items():
        assert abs(freq[tok] - p) < 0.1, (tok, freq[tok], p)
    top = max(prob_one, key=prob_one.get)
    assert prob_one[top] == pytest.approx(0.36, abs=0.01)
    if temperature != 1.0:  # far enough from T 1 that ignoring the temperature shows
        assert abs(prob[top] - prob_one[top]) > 0.2


@pytest.mark.parametrize(("top_k", "top_p", "kept"), [(2, 1.0, 2), (0, 0.3, 1), (0, 1.0, None)])
def test_top_k_and_top_p_restrict_what_the_sampler_draws(
    knob_config, monkeypatch, top_k: int, top_p: float, kept: int | None
) -> None:
    config = knob_config(
        rollout={
            "prompts_per_step": 1,
            "group_size": 400,
            "max_new_tokens": 1,
            "top_k": top_k,
            "top_p": top_p,
        },
        optim={"micro_batch_size": 400},
    )
    trainer = Trainer(config)
    peaked(trainer)
    freq, prob, _ = first_token_frequencies(trainer, monkeypatch)
    # the peaked model's most likely tokens have p = 0.36, 0.025, 0.019, ... at T 1: top_k 2
    # keeps two (renormalised: 0.935 / 0.065), top_p 0.3 only the first (0.36 >= 0.3); with
    # neither, 400 draws meet many tokens
    ranked = sorted(prob, key=prob.get, reverse=True)
    if kept is None:
        assert len(freq) > 10
        return
    assert set(freq) == set(ranked[:kept])
    z = sum(prob[t] for t in ranked[:kept])
    assert freq[ranked[0]] == pytest.approx(prob[ranked[0]] / z, abs=0.05)


# -------------------------------------------------------------------------------- precision


@pytest.mark.device
@pytest.mark.parametrize("autocast", [False, True])
def test_autocast_runs_sampling_and_scoring_in_bf16_with_float32_log_probs(
    knob_config, monkeypatch, autocast: bool
) -> None:
    precision = "bf16_autocast" if autocast else "float32"
    trainer = Trainer(knob_config(model={"precision": precision}, algorithm={"beta": 0.1}))
    device = trainer.dist.device.type
    seen: list[tuple[str, bool, torch.dtype | None]] = []
    caching: list[bool] = []

    def recorded(what: str, fn):
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            logp = result[0] if isinstance(result, tuple) else result.sampler_logp
            seen.append((what, torch.is_autocast_enabled(device), logp.dtype))
            caching.append(torch.is_autocast_cache_enabled())
            return result

        return wrapper

    monkeypatch.setattr(
        trainer.producer.engine, "generate", recorded("sample", trainer.producer.engine.generate)
    )
    monkeypatch.setattr(
        grpo.training.update,
        "completion_logprobs",
        recorded("score", grpo.training.update.completion_logprobs),
    )
    trainer.state.step = 1
    trainer.train_step()
    # the rollout, the reference forward and the update's forward
    assert seen == [(w, autocast, torch.float32) for w in ("sample", "score", "score")]
    # decoding reuses each weight's bf16 cast at every step; a scoring forward keeps none
    assert caching == [True, False, False]
    # under autocast the frozen reference holds its linear layers' weights as bf16, what the
    # products run in; the tied head stays the embedding, in float32
    ref = trainer.state.reference.copy
    want = torch.bfloat16 if autocast else torch.float32
    assert ref.model.layers[0].mlp.up_proj.weight.dtype == want
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    assert ref.lm_head.weight.dtype == torch.float32


def test_a_reference_that_refreshes_by_mixing_stays_float32_under_autocast(knob_config) -> None:
    mixing = {"beta": 0.1, "ref_update_every": 2, "ref_mix_alpha": 0.5}
    trainer = Trainer(knob_config(model={"precision": "bf16_autocast"}, algorithm=mixing))
    assert trainer.state.reference.copy.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    copying = {**mixing, "ref_mix_alpha": 1.0}
    trainer = Trainer(knob_config(model={"precision": "bf16_autocast"}, algorithm=copying))
    assert trainer.state.reference.copy.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
