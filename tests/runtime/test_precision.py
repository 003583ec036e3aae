"""`model.precision: auto`: the decision from two measured rates, and the measurement itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from grpo.runtime import precision
from grpo.runtime.precision import MatmulRates, choose_precision, measure_rates, precision_line


@pytest.mark.parametrize(
    ("float32", "bfloat16", "chosen"),
    [
        (200.0, 260.0, "bf16_autocast"),  # 1.3x: exactly the margin
        (200.0, 259.0, "float32"),  # 1.295x: just under it
        (280.0, 1450.0, "bf16_autocast"),  # an AMX Xeon: 5.2x
        (280.0, 145.0, "float32"),  # a Xeon without AMX: bf16 slower
        (300.0, 300.0, "float32"),  # no gain: bf16 would only round
    ],
)
def test_bf16_is_chosen_from_a_gain_of_1_3x(float32: float, bfloat16: float, chosen: str) -> None:
    assert choose_precision(MatmulRates(float32=float32, bfloat16=bfloat16)) == chosen


def test_the_margin_is_a_parameter() -> None:
    rates = MatmulRates(float32=100.0, bfloat16=150.0)  # 1.5x
    assert rates.gain == pytest.approx(1.5)
    assert choose_precision(rates, min_gain=1.5) == "bf16_autocast"
    assert choose_precision(rates, min_gain=1.6) == "float32"


def test_measuring_gives_both_rates_well_under_a_second() -> None:
    t0 = time.perf_counter()
    rates = measure_rates(torch.device("cpu"), 576, 1536)  # SmolLM2-135M's MLP
    elapsed = time.perf_counter() - t0
    assert rates.float32 > 0 and rates.bfloat16 > 0
    # two budgets of 0.05 s plus a warm-up product each; a busy machine gets some slack
    assert elapsed < 0.8, elapsed


class _Products(TorchFunctionMode):
    """Counts matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: object, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if getattr(func, "__name__", "") in ("matmul", "__matmul__"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_warm_up_slower_than_the_budget_is_the_measurement() -> None:
    with _Products() as products:
        rate = precision.matmul_rate(torch.float32, torch.device("cpu"), (8, 16, 32), seconds=0.0)
    assert products.count == 1 and rate > 0
    with _Products() as products:
        precision.matmul_rate(torch.float32, torch.device("cpu"), (8, 16, 32), seconds=0.2)
    # the warm-up, then whole timings of PRODUCTS_PER_TIMING products each
    assert products.count >= 1 + precision.PRODUCTS_PER_TIMING
    assert (products.count - 1) % precision.PRODUCTS_PER_TIMING == 0


def test_the_line_says_the_choice_and_both_rates() -> None:
    line = precision_line("bf16_autocast", MatmulRates(280.4, 1450.0), torch.device("cpu"))
    assert line.startswith("model.precision auto: bf16_autocast (matmul on cpu, ")
    assert "bf16 1450 GFLOP/s, float32 280 GFLOP/s, 5.17x; bf16 from 1.3x)" in line
