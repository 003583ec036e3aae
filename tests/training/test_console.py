"""What a run says on the console besides its own lines: config warnings, transformers' bars."""

from __future__ import annotations

import pytest
import transformers

from grpo.config import build_config
from grpo.training.console import K1_WARNING, TransformersBars, warn_about

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
