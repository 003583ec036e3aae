"""An update's statistics combined over micro-batches and passes (one process: the reduce over
ranks is the identity)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.training.update_stats import UpdateStats


def _loss_stats(kl: float, ratio_min: float, ratio_max: float, **more: float) -> dict:
    stats = {"kl": kl, "ratio/min": ratio_min, "ratio/max": ratio_max, **more}
    return {key: torch.tensor(value) for key, value in stats.items()}


def _mask(tokens: int, width: int = 8) -> torch.Tensor:
    return torch.arange(width)[None] < tokens  # [1, width], ``tokens`` counted


def test_loss_means_are_weighted_by_the_tokens_they_are_over() -> None:
    stats = UpdateStats()
    stats.add_pass(_loss_stats(0.1, 0.9, 1.1, **{"clip_frac/low": 0.5}), _mask(2))
    stats.add_pass(_loss_stats(0.4, 0.8, 1.05, **{"clip_frac/low": 0.0}), _mask(6))
    out = stats.reduce()
    # kl: (0.1 * 2 + 0.4 * 6) / 8 = 0.325, not the mean of the means 0.25
    assert out["kl"] == pytest.approx(0.325, abs=1e-7)
    assert out["clip_frac/low"] == pytest.approx(0.125, abs=1e-7)  # 0.5 * 2 / 8
    # minima and maxima stay minima and maxima
    assert out["ratio/min"] == pytest.approx(0.8) and out["ratio/max"] == pytest.approx(1.1)
    # only what was recorded is reported, in sorted order
    assert list(out) == ["clip_frac/low", "kl", "ratio/max", "ratio/min"]


def test_a_micro_batch_without_counted_tokens_changes_nothing() -> None:
    stats = UpdateStats()
    stats.add_pass(_loss_stats(0.2, 0.9, 1.1), _mask(4))
    # its ratio extremes are placeholders of policy_loss: never the minimum or maximum
    stats.add_pass(_loss_stats(7.0, 0.0, 100.0), _mask(0))
    out = stats.reduce()
    assert out["kl"] == pytest.approx(0.2)
    assert (out["ratio/min"], out["ratio/max"]) == pytest.approx((0.9, 1.1))


def test_an_update_over_no_counted_token_reports_nan() -> None:
    stats = UpdateStats()
    stats.add_pass(_loss_stats(0.2, 0.9, 1.1), _mask(0))
    stats.add_rollout(torch.ones(1, 8), _mask(0), None, torch.zeros(1, 8), torch.zeros(1, 8))
    out = stats.reduce()
    assert list(out) == [
        "entropy",
        "kl",
        "ratio/max",
        "ratio/min",
        "tis/mismatch_max",
        "tis/mismatch_mean",
    ]
    assert all(math.isnan(value) for value in out.values())


def test_rollout_statistics_are_over_the_loss_mask() -> None:
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    kept = torch.tensor([[True, False, False], [True, False, True]])  # the last is not counted
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.5, -2.0, 0.0], [-0.25, 9.0, 9.0]])
    stats = UpdateStats()
    stats.add_rollout(entropy, mask, kept, logp, sampler)
    out = stats.reduce()
    assert out["entropy"] == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3 counted tokens
    # the filter's kept mask is summed as given: 3 kept over 3 counted tokens
    assert out["entropy/kept_frac"] == pytest.approx(1.0)
    # |logp - sampler| on counted tokens: 0.5, 0, 0.75
    assert out["tis/mismatch_mean"] == pytest.approx(1.25 / 3)
    assert out["tis/mismatch_max"] == pytest.approx(0.75)


def test_rollout_statistics_combine_micro_batches_and_leave_out_what_is_off() -> None:
    stats = UpdateStats()
    stats.add_rollout(torch.full((1, 4), 2.0), _mask(1, 4), None, torch.zeros(1, 4), None)
    stats.add_rollout(torch.full((1, 4), 5.0), _mask(3, 4), None, torch.zeros(1, 4), None)
    # no entropy filter and no sampler log-probs: neither metric appears
    assert stats.reduce() == {"entropy": pytest.approx((2.0 + 3 * 5.0) / 4)}


def test_shares_are_what_was_touched_over_what_was_counted() -> None:
    stats = UpdateStats()
    # two micro-batches: 1 of 4 tokens touched, then 3 of 12; sequences counted apart
    stats.add_shares({"tis/truncated_frac": (1.0, 4.0), "tis/offpolicy_masked_frac": (0.0, 2.0)})
    stats.add_shares({"tis/truncated_frac": (3.0, 12.0), "tis/offpolicy_masked_frac": (1.0, 2.0)})
    assert stats.reduce() == {
        "tis/truncated_frac": pytest.approx(0.25),  # 4 / 16, whatever each micro-batch's share
        "tis/offpolicy_masked_frac": pytest.approx(0.25),  # 1 / 4
    }
    empty = UpdateStats()
    empty.add_shares({"tis/truncated_frac": (0.0, 0.0)})
    assert math.isnan(empty.reduce()["tis/truncated_frac"])
