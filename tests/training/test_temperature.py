"""Rollout temperature schedules and the adaptive rule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import grpo.training.update as trainer_module
from grpo.config import ConfigError, build_config, load_config
from grpo.training.temperature import TemperatureController, adapted, scheduled
from grpo.training.trainer import train


def test_schedules_by_hand() -> None:
    # linear 1.0 -> 1.4 over 5 steps: +0.1 per step
    assert [scheduled("linear", 1.0, 1.4, s, 5) for s in range(1, 6)] == pytest.approx(
        [1.0, 1.1, 1.2, 1.3, 1.4], abs=1e-12
    )
    # cosine: end + (start - end) * (1 + cos(pi * progress)) / 2; the middle is the mean
    assert scheduled("cosine", 1.0, 0.6, 1, 5) == pytest.approx(1.0, abs=1e-12)
    assert scheduled("cosine", 1.0, 0.6, 3, 5) == pytest.approx(0.8, abs=1e-12)
    # progress 1/4: 0.6 + 0.4 * (1 + cos(pi/4)) / 2
    expected = 0.6 + 0.4 * (1 + math.cos(math.pi / 4)) / 2
    assert scheduled("cosine", 1.0, 0.6, 2, 5) == pytest.approx(expected, abs=1e-12)
    assert scheduled("cosine", 1.0, 0.6, 5, 5) == pytest.approx(0.6, abs=1e-12)
    assert scheduled("constant", 0.7, 2.0, 3, 5) == 0.7
    assert scheduled("linear", 1.0, 2.0, 9, 5) == 2.0  # past the end: stays at the end


def test_schedules_of_one_and_two_steps() -> None:
    # one step: the start (no progress to divide by); two steps: the start, then the end
    assert scheduled("linear", 1.0, 2.0, 1, 1) == 1.0
    assert scheduled("cosine", 1.0, 0.6, 1, 1) == 1.0
    assert [scheduled("linear", 1.0, 2.0, s, 2) for s in (1, 2)] == [1.0, 2.0]
    assert [scheduled("cosine", 1.0, 0.6, s, 2) for s in (1, 2)] == pytest.approx([1.0, 0.6])


def test_an_unknown_schedule_is_named() -> None:
    with pytest.raises(ValueError, match=r"^unknown temperature schedule 'step'$"):
        scheduled("step", 1.0, 2.0, 1, 5)


def test_adaptive_rule_raises_lowers_and_stays_bounded() -> None:
    rule = dict(step=0.1, low=0.5, high=1.2, raise_above=0.5, degenerate_above=0.4)
    # mean frac_zero_std (0.75 + 0.5) / 2 = 0.625 > 0.5: hotter
    assert adapted(1.0, [0.75, 0.5], 0.0, **rule) == pytest.approx(1.1, abs=1e-12)
    # mixed groups: unchanged
    assert adapted(1.0, [0.25, 0.5], 0.0, **rule) == 1.0
    # degenerate (truncated 0.5 > 0.4) wins over the raise: cooler
    assert adapted(1.0, [1.0, 1.0], 0.5, **rule) == pytest.approx(0.9, abs=1e-12)
    # "passes" is strict: truncated exactly at degenerate_above is not degenerate, nor is a
    # zero-variance mean exactly at raise_above a reason to raise
    assert adapted(1.0, [0.0], 0.4, **rule) == 1.0
    assert adapted(1.0, [0.5, 0.5], 0.0, **rule) == 1.0
    # bounded at both ends
    assert adapted(1.15, [1.0], 0.0, **rule) == 1.2
    assert adapted(0.55, [0.0], 0.9, **rule) == 0.5


def test_controller_follows_metrics_and_restores_its_state() -> None:
    config = build_config(
        {
            "rollout": {"temperature": 1.0},
            "temperature": {"schedule": "adaptive", "window": 2, "step": 0.25, "max": 2.0},
            "train": {"steps": 10},
        }
    )
    ctl = TemperatureController(config)
    seen = []
    for zero_std, truncated in [(1.0, 0.0), (1.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.9)]:
        seen.append(ctl.for_step(len(seen) + 1))
        ctl.observe({"frac_zero_std": zero_std, "truncated_frac": truncated})
    # window means 1, 1, 0.5 (not above 0.5), 0, then a degenerate step
    assert seen == pytest.approx([1.0, 1.25, 1.5, 1.5, 1.5], abs=1e-12)
    assert ctl.for_step(6) == pytest.approx(1.25, abs=1e-12)
    again = TemperatureController(config)
    again.load_state_dict(ctl.state_dict())
    for c in (ctl, again):
        c.observe({"frac_zero_std": 1.0, "truncated_frac": 0.0})
    assert again.for_step(7) == ctl.for_step(7)
    assert again.state_dict() == ctl.state_dict()


def test_bad_bounds_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"temperature\.min"):
        load_config(None, ["temperature.min=2", "temperature.max=1"])


# ------------------------------------------------------------------------------- in the trainer


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "reward/mean" in m]  # training steps


def test_scheduled_temperature_reaches_sampling_and_scoring(tiny_config, monkeypatch) -> None:
    """linear 1.0 -> 2.0 over 3 steps: the engine samples at 1.0, 1.5, 2.0 and every log-prob
    forward of that step uses the same temperature."""
    scored_at: list[tuple[int, float]] = []
    real = trainer_module.completion_logprobs

    def recording(model, *args, **kwargs):
        decoding = args[4] if len(args) > 4 else kwargs["decoding"]
        scored_at.append(decoding.temperature)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "completion_logprobs", recording)
    config = tiny_config(
        temperature={"schedule": "linear", "end": 2.0}, train={"steps": 3, "run_name": "lin"}
    )
    run_dir = train(config)
    logged = [m["rollout/temperature"] for m in _metrics(run_dir)]
    assert logged == pytest.approx([1.0, 1.5, 2.0], abs=1e-12)
    # every log-prob forward of step k (same count per step) at step k's temperature
    per_step = len(scored_at) // 3
    assert per_step >= 1 and len(scored_at) == 3 * per_step
    expected = [t for t in (1.0, 1.5, 2.0) for _ in range(per_step)]
    assert scored_at == pytest.approx(expected, abs=1e-12)


def test_adaptive_temperature_resumes_exactly(tiny_config) -> None:
    adaptive = {"schedule": "adaptive", "step": 0.3, "window": 1, "raise_above": 0.0, "max": 3.0}
    straight = train(tiny_config(temperature=adaptive, train={"steps": 4, "run_name": "straight"}))
    train(tiny_config(temperature=adaptive, train={"steps": 2, "run_name": "resumed"}))
    resumed = train(tiny_config(temperature=adaptive, train={"steps": 4, "run_name": "resumed"}))
    a = [m["rollout/temperature"] for m in _metrics(straight)]
    b = [m["rollout/temperature"] for m in _metrics(resumed)]
    assert a == b
    # it moved: raised after every step whose groups were not all mixed, lowered when degenerate
    assert len(set(a)) > 1
