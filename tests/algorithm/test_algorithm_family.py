"""Presets of the GRPO family and the stability controls, on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from grpo.algorithm import (
    LossKnobs,
    Normalizer,
    group_advantages,
    importance_weights,
    logprob_mismatch,
    offpolicy_sequence_mask,
    policy_loss,
    soft_update_,
    top_entropy_mask,
    zero_std_groups,
)
from grpo.config import AlgorithmConfig, Config, ConfigError, build_config, dump_config
from grpo.config.presets import PRESETS
from grpo.training.update import loss_knobs

# ----------------------------------------------------------------------------- presets resolve


def test_every_preset_names_the_same_fields() -> None:
    def shape(table: dict) -> dict:
        return {s: sorted(table[s]) for s in ("algorithm", "sampling")}

    assert all(shape(table) == shape(PRESETS["grpo"]) for table in PRESETS.values())


def test_dapo_adds_the_overlong_punishment_to_default_rewards() -> None:
    config = build_config({"algorithm": {"preset": "dapo"}, "rollout": {"max_new_tokens": 50}})
    names = [spec.name for spec in config.rewards.functions]
    assert names == ["format", "accuracy", "overlong"]
    assert config.rewards.functions[-1].args == {"max_length": 50, "buffer": 10}
    own = build_config(
        {"algorithm": {"preset": "dapo"}, "rewards": {"functions": [{"name": "format"}]}}
    )
    assert [spec.name for spec in own.rewards.functions] == ["format"]  # explicit rewards win


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("grpo", dict(scale_rewards="group", loss_type="grpo", ratio_level="token", clip_low=0.2, clip_high=0.2, beta=0.04)),
        ("dapo", dict(scale_rewards="group", loss_type="dapo", ratio_level="token", clip_low=0.2, clip_high=0.28, beta=0.0)),
        ("dr_grpo", dict(scale_rewards="none", loss_type="dr_grpo", ratio_level="token", clip_low=0.2, clip_high=0.2, beta=0.0)),
        ("gspo", dict(scale_rewards="group", loss_type="grpo", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, beta=0.0)),
    ],
)  # fmt: skip
def test_preset_sets_its_published_defaults(preset: str, expected: dict) -> None:
    config = build_config({"algorithm": {"preset": preset}})
    for key, value in expected.items():
        assert getattr(config.algorithm, key) == value, key
    assert config.sampling.dynamic is (preset == "dapo")


def test_explicit_fields_win_over_the_preset() -> None:
    config = build_config(
        {
            "algorithm": {"preset": "dapo", "clip_high": 0.3, "beta": 0.01},
            "sampling": {"dynamic": False},
        }
    )
    assert (config.algorithm.clip_high, config.algorithm.beta) == (0.3, 0.01)
    assert config.sampling.dynamic is False
    assert config.algorithm.loss_type == "dapo"  # not set explicitly: the preset's


def test_preset_applies_to_python_constructed_configs() -> None:
    config = Config(algorithm=AlgorithmConfig(preset="gspo", clip_high=1e-3))
    assert (config.algorithm.ratio_level, config.algorithm.clip_low) == ("sequence", 3e-4)
    assert config.algorithm.clip_high == 1e-3


def test_resolved_config_reloads_identically() -> None:
    config = build_config({"algorithm": {"preset": "dr_grpo"}})
    again = build_config(yaml.safe_load(dump_config(config)))
    assert again == config


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ({}, {"scale_rewards": "group", "kl_estimator": "k3"}),
        # RLOO does not scale (TRL's RLOOTrainer, verl's rloo); REINFORCE++'s KL is k1
        ({"estimator": "rloo"}, {"scale_rewards": "none", "kl_estimator": "k3"}),
        ({"estimator": "reinforce_pp"}, {"scale_rewards": "group", "kl_estimator": "k1"}),
        # what the recipe sets wins, over the estimator's default and the preset's
        ({"estimator": "rloo", "scale_rewards": "group"}, {"scale_rewards": "group"}),
        ({"estimator": "reinforce_pp", "kl_estimator": "k3"}, {"kl_estimator": "k3"}),
        ({"estimator": "rloo", "preset": "dr_grpo"}, {"scale_rewards": "none", "beta": 0.0}),
    ],
)
def test_an_estimator_fills_its_defaults_before_the_preset(algorithm, expected) -> None:
    config = build_config({"algorithm": algorithm})
    for key, value in expected.items():
        assert getattr(config.algorithm, key) == value, key
    # the resolved config (config.yaml) reloads as itself
    assert build_config(yaml.safe_load(dump_config(config))) == config


def test_gdpo_without_groups_is_an_error() -> None:
    with pytest.raises(ConfigError, match="estimator reinforce_pp has no groups"):
        build_config({"algorithm": {"estimator": "reinforce_pp", "reward_aggregation": "gdpo"}})


def test_ref_refresh_without_a_reference_is_an_error() -> None:
    # dapo has beta 0: no reference model, so there is nothing to refresh
    with pytest.raises(ConfigError, match="ref_update_every needs beta > 0"):
        build_config({"algorithm": {"preset": "dapo", "ref_update_every": 5}})


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"loss_type": "sapo", "dual_clip": 2.0}, "dual_clip bounds the clipped surrogate"),
        ({"loss_type": "cispo", "dual_clip": 2.0}, "loss_type=cispo has none"),
        ({"tis_cap": 2.0, "tis_low": 0.5}, "tis_low needs tis_mode=mask"),
        ({"tis_mode": "mask"}, "tis_mode=mask tis_level=token needs a bound"),
        ({"tis_level": "sequence"}, "tis_level=sequence needs a bound"),
    ],
)
def test_loss_and_correction_combinations_that_would_do_nothing_are_errors(
    algorithm: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config({"algorithm": algorithm})


def test_tis_cap_alone_is_token_level_truncation() -> None:
    # the field as it always was: min(pi_old / pi_sampler, cap) per token
    algo = build_config({"algorithm": {"tis_cap": 2.0}}).algorithm
    assert (algo.tis_level, algo.tis_mode, algo.tis_low) == ("token", "truncate", None)
    masked = build_config({"algorithm": {"tis_low": 0.5, "tis_mode": "mask"}}).algorithm
    assert masked.tis_cap is None  # a lower bound alone is a correction too


def test_soft_mixing_with_lora_is_an_error() -> None:
    with pytest.raises(ConfigError, match="ref_mix_alpha < 1 needs full weights"):
        build_config(
            {
                "model": {"lora": {"enabled": True}},
                "algorithm": {"ref_update_every": 2, "ref_mix_alpha": 0.5},
            }
        )


# ----------------------------------------------------------------------------- presets' formulas
#
# One group of G=2: rewards [1, 0]. Completion 0 has 1 token with ratio 1.5; completion 1 has
# 2 tokens with ratios 0.5 and 1.0. For the grpo preset the reference sits ln 2 below the policy
# on completion 0's token: k3 = exp(-ln 2) + ln 2 - 1 = 0.5 + 0.693147 - 1 = 0.193147.

REWARDS = torch.tensor([1.0, 0.0])
MASK = torch.tensor([[True, False], [True, True]])
LOGP = torch.log(torch.tensor([[0.3, 0.2], [0.4, 0.6]]))
OLD = LOGP - torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]]))
REF = LOGP - torch.tensor([[math.log(2.0), 0.0], [0.0, 0.0]])
MAX_NEW_TOKENS = 4


def preset_loss(preset: str) -> float:
    cfg = build_config({"algorithm": {"preset": preset}}).algorithm
    adv = group_advantages(REWARDS, 2, cfg.scale_rewards, cfg.adv_eps)
    norm = Normalizer(num_sequences=2, num_tokens=3.0, max_new_tokens=MAX_NEW_TOKENS)
    loss, _ = policy_loss(
        LOGP,
        OLD,
        adv,
        MASK,
        REF if cfg.beta else None,
        knobs=loss_knobs(cfg, entropy_coef=0.0),  # the trainer's knobs from the preset
        normalizer=norm,
    )
    return float(loss)


def test_grpo_preset_formula() -> None:
    # A = [+1, -1]. Completion 0: -min(1.5, 1.2) + 0.04 * 0.193147 = -1.192274.
    # Completion 1: -min(-0.5, -0.8) = 0.8 and -min(-1, -1) = 1 -> token mean 0.9.
    # Mean over the 2 completions of their token means: (-1.192274 + 0.9) / 2 = -0.146137
    assert preset_loss("grpo") == pytest.approx(-0.146137, abs=1e-6)


def test_dapo_preset_formula() -> None:
    # clip-higher: completion 0 gets -min(1.5, 1.28) = -1.28; completion 1 as above 0.8, 1.
    # Token mean over the step's 3 tokens: (-1.28 + 0.8 + 1.0) / 3 = 0.173333
    assert preset_loss("dapo") == pytest.approx(0.52 / 3, abs=1e-6)


def test_dr_grpo_preset_formula() -> None:
    # No std scaling: A = [0.5, -0.5]. Tokens: -min(0.75, 0.6) = -0.6; -min(-0.25, -0.4) = 0.4;
    # -min(-0.5, -0.5) = 0.5. Sum 0.3 over the budget 2 sequences x 4 tokens: 0.3 / 8 = 0.0375
    assert preset_loss("dr_grpo") == pytest.approx(0.0375, abs=1e-6)


def test_gspo_preset_formula() -> None:
    # Sequence ratios: s0 = 1.5, s1 = exp((ln 0.5 + 0) / 2) = 0.707107.
    # Completion 0: -min(1.5, 1.0004) = -1.0004. Completion 1 (A = -1): -min(-0.707107, -0.9997)
    # = 0.9997 on each token. Mean of per-sequence means: (-1.0004 + 0.9997) / 2 = -0.00035
    assert preset_loss("gspo") == pytest.approx(-0.00035, abs=1e-6)


def test_gspo_gradient_is_shared_by_the_sequence() -> None:
    # unclipped (ratio 1): loss = -(1/G) sum_i A_i s_i, ds_i/dlogp_t = s_i / |o_i| = 1 / |o_i|,
    # so every token of completion i gets -A_i / (G |o_i|): [-0.5, 0] and [0.25, 0.25]
    logp = LOGP.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(
        logp,
        LOGP,
        adv,
        MASK,
        knobs=LossKnobs(clip_low=3e-4, clip_high=4e-4, ratio_level="sequence"),
    )
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 0.0], [0.25, 0.25]]), atol=1e-6)


# ----------------------------------------------------------------------------- stability controls


def test_zero_std_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    assert zero_std_groups(rewards, 2).tolist() == [True, False, True, True]


def test_truncated_importance_weights_and_cap() -> None:
    # trainer p = 0.5 vs sampler 0.25 -> ratio 2 capped at 1.5; 0.9 vs 0.9 -> 1; 0.2 vs 0.4 -> 0.5
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    sampler = torch.log(torch.tensor([[0.25, 0.9, 0.4]]))
    weights, stats = importance_weights(old, sampler, torch.ones(1, 3, dtype=torch.bool), cap=1.5)
    assert torch.allclose(weights, torch.tensor([[1.5, 1.0, 0.5]]), atol=1e-6)
    assert float(stats["truncated_frac"]) == pytest.approx(1 / 3, abs=1e-6)  # the 2 only
    assert float(stats["masked_frac"]) == 0


def test_importance_weights_scale_the_surrogate() -> None:
    # one token, ratio 1, A = 1 -> surrogate -1; weight 1.5 -> loss -1.5
    logp = torch.zeros(1, 1)
    loss, _ = policy_loss(
        logp, logp, torch.ones(1), torch.ones(1, 1, dtype=torch.bool),
        importance_weights=torch.full((1, 1), 1.5),
    )  # fmt: skip
    assert float(loss) == pytest.approx(-1.5, abs=1e-6)


def test_logprob_mismatch() -> None:
    # |ln 0.5 - ln 0.25| = ln 2 = 0.693147 and 0 on counted tokens; the masked 9.0 is ignored
    trainer = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    sampler = torch.tensor([[math.log(0.25), math.log(0.9), 9.0]])
    out = logprob_mismatch(trainer, sampler, torch.tensor([[True, True, False]]))
    assert float(out["mismatch_mean"]) == pytest.approx(math.log(2) / 2, abs=1e-6)
    assert float(out["mismatch_max"]) == pytest.approx(math.log(2), abs=1e-6)


def test_top_entropy_mask_hand_example() -> None:
    # counted entropies sorted [0.1, 0.3, 0.5, 0.7, 0.9]; quantile 0.4 keeps >= the 0.6 quantile:
    # position 0.6 * 4 = 2.4 -> 0.5 + 0.4 * (0.7 - 0.5) = 0.58 -> keeps 0.9 and 0.7 only
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    kept = top_entropy_mask(entropy, mask, 0.4)
    assert kept.tolist() == [[False, False, True], [False, True, False]]
    assert torch.equal(top_entropy_mask(entropy, mask, 1.0), mask)


def test_pg_mask_zeroes_tokens_but_keeps_the_denominator() -> None:
    # dapo example without completion 1's last token: (-1.28 + 0.8 + 0) / 3 tokens = -0.16
    adv = torch.tensor([1.0, -1.0])
    pg_mask = torch.tensor([[True, False], [True, False]])
    loss, _ = policy_loss(
        LOGP,
        OLD,
        adv,
        MASK,
        knobs=LossKnobs(clip_low=0.2, clip_high=0.28, loss_type="dapo"),
        pg_mask=pg_mask,
    )
    assert float(loss) == pytest.approx(-0.16, abs=1e-6)


def test_pg_mask_gradient() -> None:
    # ratio 1, dapo: d loss / d logp = -A / (3 tokens) on kept tokens, 0 on the filtered one
    logp = LOGP.clone().requires_grad_(True)
    pg_mask = torch.tensor([[True, False], [True, False]])
    loss, _ = policy_loss(
        logp,
        LOGP,
        torch.tensor([1.0, -1.0]),
        MASK,
        knobs=LossKnobs(loss_type="dapo"),
        pg_mask=pg_mask,
    )
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, 0.0], [1 / 3, 0.0]]), atol=1e-6)


def test_pg_mask_keeps_the_kl_term() -> None:
    # ratio 1, A = 0, ref ln 2 below: the surrogate is 0 and the k3 KL 0.193147 stays, x beta 0.5
    logp = torch.zeros(1, 1)
    ref = logp - math.log(2.0)
    loss, _ = policy_loss(
        logp,
        logp,
        torch.zeros(1),
        torch.ones(1, 1, dtype=torch.bool),
        ref,
        knobs=LossKnobs(beta=0.5),
        pg_mask=torch.zeros(1, 1, dtype=torch.bool),
    )
    assert float(loss) == pytest.approx(0.5 * (0.5 + math.log(2) - 1), abs=1e-6)


def test_soft_update() -> None:
    # alpha 0.25: 0.25 * 8 + 0.75 * 4 = 5; integer buffers are copied, never mixed
    target, source = torch.full((3,), 4.0), torch.full((3,), 8.0)
    counter, new_counter = torch.tensor([1]), torch.tensor([7])
    soft_update_([target, counter], [source, new_counter], alpha=0.25)
    assert torch.allclose(target, torch.full((3,), 5.0))
    assert counter.tolist() == [7]
    soft_update_([target], [source], alpha=1.0)
    assert torch.equal(target, source)


# ----------------------------------------------------------------------------- bounds and edges


def test_cispo_weight_on_its_bound_is_not_clipped() -> None:
    # cispo_clip_low 0.5, cispo_clip_high 1: weights in [0.5, 2]. Four one-token completions, old
    # log-prob 0, A = +1, -1, +1, -1; ratios 2 and 0.5 sit on the bounds (exact in float32), 4
    # and 0.25 lie outside: weights w = 2, 0.5, 2, 0.5.
    # Loss -w * A * logp: -2 ln 2 = -1.386294; 0.5 ln 0.5 = -0.346574; -2 ln 4 = -2.772589;
    # 0.5 ln 0.25 = -0.693147. Token mean over the step's 4 tokens: -5.198604 / 4 = -1.299651
    logp = torch.log(torch.tensor([[2.0], [0.5], [4.0], [0.25]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = policy_loss(
        logp,
        torch.zeros(4, 1),
        adv,
        torch.ones(4, 1, dtype=torch.bool),
        knobs=LossKnobs(loss_type="cispo", cispo_clip_low=0.5, cispo_clip_high=1.0),
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.299651, abs=1e-6)
    # d/dlogp = -w * A / 4: the clipped tokens keep a gradient, of the bound's weight
    assert torch.allclose(logp.grad.flatten(), torch.tensor([-0.5, 0.125, -0.5, 0.125]), atol=1e-6)
    # a ratio on a bound keeps its own weight, so only the 4 and the 0.25 count as clipped
    assert float(stats["clip_frac/high"]) == pytest.approx(0.25, abs=1e-6)
    assert float(stats["clip_frac/low"]) == pytest.approx(0.25, abs=1e-6)
    # cispo_clip_low unset is no lower bound (the paper's choice): the 0.25 keeps its own weight,
    # 0.25 ln 0.25 = -0.346574 for -0.693147, so the mean is -4.852030 / 4 = -1.213008
    loss, stats = policy_loss(
        logp,
        torch.zeros(4, 1),
        adv,
        torch.ones(4, 1, dtype=torch.bool),
        knobs=LossKnobs(loss_type="cispo", cispo_clip_high=1.0),
    )
    assert float(loss.detach()) == pytest.approx(-1.213008, abs=1e-6)
    assert float(stats["clip_frac/low"]) == 0


def test_importance_weight_bounds_are_inclusive_and_none_is_no_bound() -> None:
    # pi_old / pi_sampler: 0.5 / 0.25 = 2, 0.25 / 0.5 = 0.5 (exact in float32), 1, 0.8 / 0.1 = 8
    old = torch.log(torch.tensor([[0.5, 0.25, 0.9, 0.8]]))
    sampler = torch.log(torch.tensor([[0.25, 0.5, 0.9, 0.1]]))
    mask = torch.ones(1, 4, dtype=torch.bool)
    # mask mode keeps low <= w <= cap: with [0.5, 2] the 2 and the 0.5 stay, only the 8 drops
    w, stats = importance_weights(old, sampler, mask, cap=2.0, low=0.5, mode="mask")
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0, 0.0]]), atol=1e-6)
    assert float(stats["masked_frac"]) == pytest.approx(0.25, abs=1e-6)
    # truncation at 2 cuts the 8 and counts it; the 2 already on the cap is not truncated
    w, stats = importance_weights(old, sampler, mask, cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0, 2.0]]), atol=1e-6)
    assert float(stats["truncated_frac"]) == pytest.approx(0.25, abs=1e-6)
    # no cap: the weights as they are, nothing truncated or masked
    w, stats = importance_weights(old, sampler, mask, cap=None)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0, 8.0]]), atol=1e-5)
    assert (float(stats["truncated_frac"]), float(stats["masked_frac"])) == (0.0, 0.0)


def test_importance_weights_say_what_they_refuse() -> None:
    logp, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"^importance_weights: a lower bound only masks \(mode='mask'\)$"
    ):
        importance_weights(logp, logp, mask, cap=2.0, low=0.5)
    with pytest.raises(ValueError, match=r"^mode must be 'truncate' or 'mask', got 'clip'$"):
        importance_weights(logp, logp, mask, cap=2.0, mode="clip")


def test_offpolicy_divergence_is_each_completions_own_token_mean() -> None:
    # delta 0.5. log pi_behaviour - log pi_current on counted tokens (masked slots hold 9):
    #   A = -1, one token 0.8         -> mean 0.8 > 0.5: dropped
    #   A = -1, tokens 0.8, 0, 0      -> mean 0.8 / 3 = 0.267: kept
    #   A = -1, tokens 1, 0           -> mean 0.5, not above 0.5: kept
    #   A =  0, tokens 2, 2           -> mean 2, but only A < 0 drops: kept
    #   A = -1, no counted token      -> nothing diverged: kept
    current = torch.zeros(5, 3)
    behaviour = torch.tensor(
        [[0.8, 9, 9], [0.8, 0.0, 0.0], [1.0, 0.0, 9], [2.0, 2.0, 9], [9, 9, 9]]
    )
    mask = torch.tensor(
        [[True, False, False], [True, True, True], [True, True, False], [True, True, False],
         [False, False, False]]
    )  # fmt: skip
    adv = torch.tensor([-1.0, -1.0, -1.0, 0.0, -1.0])
    keep = offpolicy_sequence_mask(current, behaviour, adv, mask, delta=0.5)
    assert keep.tolist() == [False, True, True, True, True]


def test_offpolicy_mask_signs_per_token_advantages_by_their_mean() -> None:
    # every counted gap is 1 > delta 0.5, so each completion's mean advantage over its own
    # counted tokens decides; the masked third slot's +-9 is ignored:
    #   -1, -1 (| +9)  mean -1:   dropped (with the 9 the mean would be +7/3)
    #   +1, -1 (| -9)  mean 0:    kept
    #   +2, -1 (| -9)  mean +0.5: kept (the batch's sum, -2 + 0 + 1 = -1, would drop it)
    current = torch.zeros(3, 3)
    behaviour = torch.ones(3, 3)
    adv = torch.tensor([[-1.0, -1.0, 9.0], [1.0, -1.0, -9.0], [2.0, -1.0, -9.0]])
    mask = torch.tensor([[True, True, False]] * 3)
    keep = offpolicy_sequence_mask(current, behaviour, adv, mask, delta=0.5)
    assert keep.tolist() == [False, True, True]


def test_policy_loss_defaults_are_the_configs_cispo_and_sapo_knobs() -> None:
    # a direct call without the knobs runs CISPO and SAPO as a default config does:
    # cispo_clip_high 4 and the paper's SAPO temperatures 1 (A > 0) and 1.05 (A <= 0)
    cfg = AlgorithmConfig()
    assert (cfg.cispo_clip_high, cfg.sapo_tau_pos, cfg.sapo_tau_neg) == (4.0, 1.0, 1.05)
    mask = torch.ones(2, 1, dtype=torch.bool)
    # CISPO, A = +1, +1, ratios 6 and 2: weights 5 (clipped at 1 + 4) and 2; token mean over 2,
    # so d loss / d logp = -w * A / 2 = -2.5, -1
    logp = torch.log(torch.tensor([[6.0], [2.0]])).requires_grad_(True)
    loss, stats = policy_loss(
        logp, torch.zeros(2, 1), torch.tensor([1.0, 1.0]), mask, knobs=LossKnobs(loss_type="cispo")
    )
    loss.backward()
    assert torch.allclose(logp.grad.flatten(), torch.tensor([-2.5, -1.0]), atol=1e-6)
    assert float(stats["clip_frac/high"]) == pytest.approx(0.5)
    # SAPO, ratio 2 for A = +1 and A = -1: gate sigmoid(tau) * 4 / tau = 2.924234 (tau 1) and
    # 2.822000 (tau 1.05); mean over 2 one-token completions: (-2.924234 + 2.822000) / 2
    logp = torch.log(torch.tensor([[2.0], [2.0]])).requires_grad_(True)
    loss, _ = policy_loss(
        logp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), mask, knobs=LossKnobs(loss_type="sapo")
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.051117, abs=1e-5)
    # d/dlogp = -A * 4 s (1 - s) * rho / 2 with s = sigmoid(tau): -0.786448 and +0.768110
    assert torch.allclose(logp.grad.flatten(), torch.tensor([-0.786448, 0.768110]), atol=1e-5)
