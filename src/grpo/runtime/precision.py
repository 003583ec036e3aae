"""``model.precision: auto``: bf16 autocast or float32, chosen by measuring this device.

A bf16 matrix product is 4-9x the float32 one on a GPU or on a CPU with bf16 units (AMX,
AVX512-BF16) and slower than float32 on a CPU without them (a Xeon without AMX: 0.5x), so
the choice is measured, not assumed. The measurement times products of a decoder layer's MLP
shape, ``[rows, hidden] x [hidden, intermediate]``, in each dtype on the run's device and
thread count: a warm-up product first (thread pool, kernel selection), then the best of
repeats within a short budget. bf16 is chosen when it is at least ``BF16_MIN_GAIN`` times as
fast: below that its rounding costs more than it saves (sampler and trainer log-probs agree to
~0.03 nats instead of 1e-5, docs/results/precision.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

BF16_MIN_GAIN = 1.3

# rows of the timed product: on a CPU few, so that one without bf16 kernels (0.75 GFLOP/s on an
# AVX2 EPYC) still answers in a fraction of a second; on a GPU many, so that the products, not
# their launches, are timed
CPU_ROWS, ACCELERATOR_ROWS = 128, 4096
PRODUCTS_PER_TIMING = 4  # queued between two synchronisations on a GPU
SECONDS_PER_DTYPE = 0.05


@dataclass(frozen=True)
class MatmulRates:
    """Measured matrix-product rates on one device, GFLOP/s."""

    float32: float
    bfloat16: float

    @property
    def gain(self) -> float:
        """bf16's rate over float32's."""
        return self.bfloat16 / self.float32


def choose_precision(rates: MatmulRates, min_gain: float = BF16_MIN_GAIN) -> str:
    """``bf16_autocast`` where bf16 multiplies at least ``min_gain`` times as fast as float32,
    else ``float32``."""
    return "bf16_autocast" if rates.gain >= min_gain else "float32"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(
    dtype: torch.dtype,
    device: torch.device,
    shape: tuple[int, int, int],
    seconds: float = SECONDS_PER_DTYPE,
) -> float:
    """GFLOP/s of ``[m, k] x [k, n]`` products (``shape`` = m, k, n) in ``dtype`` on ``device``:
    the best of repeated timings within ``seconds`` after a warm-up. A warm-up slower than the
    whole budget is the answer itself: the dtype is clearly slow here."""
    m, k, n = shape
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    flops = 2.0 * m * k * n

    def timed(products: int) -> float:  # seconds per product
        _synchronize(device)
        t0 = time.perf_counter()
        for _ in range(products):
            a @ b
        _synchronize(device)
        return (time.perf_counter() - t0) / products

    best = timed(1)
    if best < seconds:
        best = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            best = min(best, timed(PRODUCTS_PER_TIMING))
    return flops / best / 1e9


def measure_rates(device: torch.device, hidden: int, intermediate: int) -> MatmulRates:
    """float32 and bf16 rates of a ``[rows, hidden] x [hidden, intermediate]`` product on
    ``device`` with the current thread count."""
    rows = CPU_ROWS if device.type == "cpu" else ACCELERATOR_ROWS
    shape = (rows, hidden, intermediate)
    return MatmulRates(
        float32=matmul_rate(torch.float32, device, shape),
        bfloat16=matmul_rate(torch.bfloat16, device, shape),
    )


def precision_line(chosen: str, rates: MatmulRates, device: torch.device) -> str:
    """The console line of an ``auto`` decision."""
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return (
        f"model.precision auto: {chosen} (matmul on {device}{threads}: bf16 "
        f"{rates.bfloat16:.0f} GFLOP/s, float32 {rates.float32:.0f} GFLOP/s, {rates.gain:.2f}x; "
        f"bf16 from {BF16_MIN_GAIN}x)"
    )
