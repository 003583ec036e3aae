"""``model.precision: auto``: bf16 autocast or float32, chosen by measuring this device.

A bf16 matrix product is several times the float32 one on a GPU (an H200, this measurement at
SmolLM2's to a 7B model's MLP shape: 10-15x; 1.9x against TF32) or on a CPU with bf16 units (an
AMX Xeon, 1024^3: 1,350-1,630 against 150-300 GFLOP/s), and slower than float32 on a CPU
without them (a Xeon without AMX: 0.5x), so the choice is measured, not assumed. The measurement times products of a decoder layer's MLP
shape, ``[rows, hidden] x [hidden, intermediate]``, in each dtype on the run's device and
thread count: a small warm-up product first (thread pool, first-call set-up), then the best of
repeated timings within a tenth of a second, the two dtypes alternated. bf16 is chosen when it
is at least ``BF16_MIN_GAIN`` times as fast: below that its rounding costs more than it saves
(sampler and trainer log-probs agree to ~0.03 nats instead of 1e-5, docs/results/precision.md).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

BF16_MIN_GAIN = 1.3

# rows of the timed product: on a CPU few, so that one without bf16 kernels (0.75 GFLOP/s on an
# AVX2 EPYC) still answers in a fraction of a second; on a GPU many, and several products
# queued between two synchronisations, so that the products, not their launches, are timed
CPU_ROWS, GPU_ROWS = 128, 4096
CPU_PRODUCTS, GPU_PRODUCTS = 1, 4
WARM_UP_ROWS = 8
SECONDS = 0.1
# a CPU shared with other jobs stalls a product now and then (15-45 ms at a time seen under a
# cgroup quota, for a product of 0.03 ms): a few rounds even past the budget, up to GIVE_UP
# budgets; a dtype slower than that is timed once, being clearly slow here
MIN_ROUNDS, GIVE_UP = 3, 4


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


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a GPU's), so that a clock read after it counts it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def product_timer(
    dtype: torch.dtype, device: torch.device, shape: tuple[int, int, int]
) -> Callable[[], float]:
    """A function that times ``[m, k] x [k, n]`` products (``shape`` = m, k, n) in ``dtype`` on
    ``device`` and returns the seconds of one; warmed up on a few rows first (the thread pool
    and the libraries' first-call set-up, no measure of the product)."""
    m, k, n = shape
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    products = CPU_PRODUCTS if device.type == "cpu" else GPU_PRODUCTS
    a[:WARM_UP_ROWS] @ b

    def timed() -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(products):
            a @ b
        synchronize(device)
        return (time.perf_counter() - t0) / products

    return timed


def measure_rates(
    device: torch.device, hidden: int, intermediate: int, seconds: float = SECONDS
) -> MatmulRates:
    """float32 and bf16 rates of a ``[rows, hidden] x [hidden, intermediate]`` product on
    ``device`` with the current thread count: the best timing of each, the two dtypes
    alternated round by round within ``seconds`` so that other jobs slow both alike."""
    shape = (CPU_ROWS if device.type == "cpu" else GPU_ROWS, hidden, intermediate)
    timers = {
        dtype: product_timer(dtype, device, shape) for dtype in (torch.float32, torch.bfloat16)
    }
    best = dict.fromkeys(timers, math.inf)
    start, rounds = time.perf_counter(), 0
    while True:
        for dtype, timed in timers.items():
            best[dtype] = min(best[dtype], timed())
        rounds += 1
        spent = time.perf_counter() - start
        if spent >= seconds and (rounds >= MIN_ROUNDS or spent >= GIVE_UP * seconds):
            break
    flops = 2.0 * math.prod(shape)
    return MatmulRates(
        float32=flops / best[torch.float32] / 1e9, bfloat16=flops / best[torch.bfloat16] / 1e9
    )


def precision_line(chosen: str, rates: MatmulRates, device: torch.device) -> str:
    """The console line of an ``auto`` decision."""
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return (
        f"model.precision auto: {chosen} (matmul on {device}{threads}: bf16 "
        f"{rates.bfloat16:.0f} GFLOP/s, float32 {rates.float32:.0f} GFLOP/s, {rates.gain:.2f}x; "
        f"bf16 from {BF16_MIN_GAIN}x)"
    )


def bf16_autocast(
    device: torch.device, enabled: bool, cache: bool = True
) -> contextlib.AbstractContextManager:
    """bf16 autocast over float32 weights when ``enabled`` (``model.precision``); log-probs stay
    float32.

    ``cache``: keep each weight's bf16 cast for the whole context. Generation reuses it at every
    decoding step; a scoring forward uses each weight once, so there the cache only holds a bf16
    copy of every trained weight until the forward ends (SmolLM2: 210 MiB, by arithmetic), where
    without it a cast lives as long as autograd needs it: not at all in a no-grad or
    checkpointed forward."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=cache)
