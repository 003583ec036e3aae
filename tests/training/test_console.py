"""What a run says on the console besides its own lines: config warnings, transformers' bars."""

from __future__ import annotations

import pytest
import transformers

from grpo.config import build_config
from grpo.training.console import (
    K1_WARNING,
    TransformersBars,
    staleness_beyond_the_run,
    warn_about,
)

bars = transformers.utils.logging


@pytest.fixture
def bars_on():
    """transformers' bars on for the test, and as they were after it."""
    were_on = bars.is_progress_bar_enabled()
    bars.enable_progress_bar()
    yield
    (bars.enable_progress_bar if were_on else bars.disable_progress_bar)()


def test_progress_off_turns_the_bars_off_until_restored(bars_on) -> None:
    quiet = TransformersBars(progress=False)
    assert not bars.is_progress_bar_enabled()
    quiet.restore()
    assert bars.is_progress_bar_enabled()


def test_progress_on_leaves_the_bars_alone(bars_on) -> None:
    TransformersBars(progress=True).restore()
    assert bars.is_progress_bar_enabled()
    bars.disable_progress_bar()  # the user's own choice survives a run
    quiet = TransformersBars(progress=False)
    quiet.restore()
    assert not bars.is_progress_bar_enabled()


@pytest.mark.parametrize(
    ("beta", "estimator", "warned"),
    [(0.04, "k1", True), (0.0, "k1", False), (0.04, "k3", False), (0.04, "k2", False)],
)
def test_k1_in_the_loss_is_warned_about(capsys, beta: float, estimator: str, warned: bool) -> None:
    warn_about(build_config({"algorithm": {"beta": beta, "kl_estimator": estimator}}))
    assert capsys.readouterr().err == (K1_WARNING + "\n" if warned else "")


@pytest.mark.parametrize(
    ("staleness", "steps", "warned"),
    # 30 steps: step 30 samples with the weights after step 29 - k, trained ones for k <= 28
    [(0, 30, False), (1, 30, False), (28, 30, False), (29, 30, True), (1000, 30, True)],
)
def test_a_staleness_no_step_can_use_is_one_line(
    capsys, staleness: int, steps: int, warned: bool
) -> None:
    tree = {"rollout": {"max_staleness": staleness}, "train": {"steps": steps}}
    config = build_config({**tree, "algorithm": {"tis_cap": 2.0}})
    warn_about(config)
    err = capsys.readouterr().err
    if warned:
        assert err == staleness_beyond_the_run(staleness, steps) + "\n"
        assert f"max_staleness={staleness} with train.steps={steps}" in err
        assert "at most 28 lets a step sample with trained weights" in err
    else:
        assert err == ""
