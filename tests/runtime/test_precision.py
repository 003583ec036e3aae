"""`model.precision: auto`: the decision from two measured rates, and the measurement itself."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch_calls import RowsOf

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


def test_measuring_gives_both_rates_at_a_models_shape() -> None:
    # no wall-clock bound: a shared machine may stall any product (the budget's rounds are
    # counted in the tests below)
    rates = measure_rates(torch.device("cpu"), 576, 1536)  # SmolLM2-135M's MLP
    assert rates.float32 > 0 and rates.bfloat16 > 0 and math.isfinite(rates.gain)


def test_the_dtypes_alternate_after_a_warm_up_on_a_few_rows(monkeypatch) -> None:
    dtypes = []
    timer = precision.product_timer

    def recorded(dtype, device, shape):
        timed = timer(dtype, device, shape)
        return lambda: dtypes.append(dtype) or timed()

    monkeypatch.setattr(precision, "product_timer", recorded)
    with RowsOf(lambda f: getattr(f, "__name__", "") in ("matmul", "__matmul__")) as products:
        measure_rates(torch.device("cpu"), 16, 32, seconds=0.05)
    # each dtype's warm-up on WARM_UP_ROWS rows, then CPU_ROWS-row products, one per timing
    warm = precision.WARM_UP_ROWS
    assert products.rows[:2] == [warm, warm]
    assert set(products.rows[2:]) == {precision.CPU_ROWS}
    assert len(dtypes) >= 2 * precision.MIN_ROUNDS and len(dtypes) % 2 == 0
    assert dtypes == [torch.float32, torch.bfloat16] * (len(dtypes) // 2)


def test_a_slow_dtype_is_timed_once(monkeypatch) -> None:
    # a bf16 product that takes the whole budget and more (a CPU without bf16 kernels): one
    # round, not MIN_ROUNDS of them
    timer = precision.product_timer
    slow: list[int] = []

    def slow_bf16(dtype, device, shape):
        timed = timer(dtype, device, shape)
        if dtype != torch.bfloat16:
            return timed
        return lambda: slow.append(1) or time.sleep(0.25) or 0.25

    monkeypatch.setattr(precision, "product_timer", slow_bf16)
    rates = measure_rates(torch.device("cpu"), 16, 32, seconds=0.05)
    assert slow == [1]
    assert rates.bfloat16 == pytest.approx(2 * 128 * 16 * 32 / 0.25 / 1e9)
    assert choose_precision(rates) == "float32"


def test_one_stalled_product_is_not_the_measurement(monkeypatch) -> None:
    # on a shared CPU a product stalls now and then (40 ms where it takes 0.1): the best of the
    # rounds is taken, so one stall in float32 does not make bf16 look 400 times faster
    def timer(dtype, device, shape):
        stalls = [dtype == torch.float32]

        def timed() -> float:
            seconds = 0.04 if stalls and stalls.pop() else 1e-4
            time.sleep(seconds)
            return seconds

        return timed

    monkeypatch.setattr(precision, "product_timer", timer)
    rates = measure_rates(torch.device("cpu"), 16, 32, seconds=0.02)
    assert rates.float32 == pytest.approx(2 * 128 * 16 * 32 / 1e-4 / 1e9)
    assert rates.gain == pytest.approx(1.0)
    assert choose_precision(rates) == "float32"


def test_the_line_says_the_choice_and_both_rates() -> None:
    line = precision_line("bf16_autocast", MatmulRates(280.4, 1450.0), torch.device("cpu"))
    assert line.startswith("model.precision auto: bf16_autocast (matmul on cpu, ")
    assert "bf16 1450 GFLOP/s, float32 280 GFLOP/s, 5.17x; bf16 from 1.3x)" in line
