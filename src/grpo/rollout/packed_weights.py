"""Sampling's linear layers on weights packed once into oneDNN's blocked layout.

``F.linear`` takes a weight as it is at every call, and the CPU library behind it lays panels of
it out afresh for each product. A decode step's products have few rows, so that re-layout is a
large part of each one: on SmolLM2's shapes at 32 rows a packed bf16 weight takes 0.6-0.8x the
time, and on an AMD EPYC a packed float32 one 0.61x MKL's (docs/results/rollout-speed.md).
Packing costs one reorder of each weight per sampling session (a rollout, or evaluation's
batches) and holds the packed copy while sampling.

bf16 products are packed wherever oneDNN has bf16 kernels: they are the same bf16 products bit
for bit at SmolLM2's widths, with and without bias (tested). Float32 products are packed only when
asked (``rollout.pack_float32``) and where timed faster on this CPU (``float32_packing_pays``):
oneDNN's kernels sum in another order than MKL's, so a packed float32 product differs from
``F.linear``'s by rounding; through SmolLM2's 30 layers that moves sampled log-probs by up to
5e-5, and a few completions take another token where two were close (counted in the
rollout-speed benchmark). Unasked, float32 sampling keeps ``F.linear``'s products bit for bit.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import time
from collections.abc import Iterator

import torch
from torch import nn

# the rows a decode step's products have in the default recipe (4 prompts x 8), where float32
# packing is timed; on an AMD EPYC oneDNN's took 0.45-0.74x MKL's time from 1 to 128 rows
PROBE_ROWS = 32
# float32 is packed only for a clear gain: packing costs a reorder per session and a copy held
MIN_GAIN = 1.1
# weights timed at most (elements): past any CPU cache, so each product reads its weight from
# memory as in a decode step, yet a 7B model's probe stays a fraction of a second
PROBE_ELEMENTS = 2**26
# below this many weight elements in all (a test's tiny model) float32 is never packed: the
# products are too small for the timing to mean anything, and the choice would flip between runs
MIN_FLOAT32_ELEMENTS = 2**22


def _bf16_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def compute_dtype(module: nn.Linear) -> torch.dtype:
    """The dtype ``F.linear`` multiplies ``module``'s input and weight in at this moment."""
    return torch.bfloat16 if _bf16_autocast() else module.weight.dtype


def _packed_linear(
    module: nn.Linear,
    dtype: torch.dtype,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    x: torch.Tensor,
) -> torch.Tensor:
    # what F.linear would multiply in, decided at each call: a layer called in another dtype than
    # it was packed for (a router run with autocast turned off) runs as it is
    if compute_dtype(module) != dtype:
        return nn.Linear.forward(module, x)
    return torch.ops.mkldnn._linear_pointwise(x.to(dtype), weight, bias, "none", [], "")


def _kernels(dtype: torch.dtype) -> bool:
    """Whether torch has oneDNN's packed-weight ops (as inductor uses them) for ``dtype``."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and all(hasattr(ops, n) for n in ("_reorder_linear_weight", "_linear_pointwise"))
        and (dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported()))
    )


def _packable(module: nn.Module) -> bool:
    # a subclass (quantised layers, PEFT's LoRA wrapper, whose inner layers are plain), a
    # sharded weight or a forward replaced on the instance (accelerate's hooks) runs as it is
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and "forward" not in vars(module)
        and type(weight.data) is torch.Tensor
        and weight.device.type == "cpu"
    )


def _pack(module: nn.Linear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach().to(dtype))
    bias = None if module.bias is None else module.bias.detach().to(dtype)
    return weight, bias


# the float32 layers' shapes -> whether packing them pays on this CPU (measured once a process)
_FLOAT32_PAYS: dict[tuple[tuple[int, int], ...], bool] = {}


def _time_products(layers: list[nn.Linear], packed: list | None, inputs: dict) -> float:
    start = time.perf_counter()
    for i, layer in enumerate(layers):
        x = inputs[layer.in_features]
        if packed is None:
            torch.nn.functional.linear(x, layer.weight, layer.bias)
        else:
            torch.ops.mkldnn._linear_pointwise(x, *packed[i], "none", [], "")
    return time.perf_counter() - start


@torch.no_grad()
def float32_packing_pays(layers: list[nn.Linear]) -> bool:
    """Whether oneDNN's packed float32 products beat ``F.linear``'s on these layers here.

    Timed once a process per set of shapes, on the layers' own weights (up to
    ``PROBE_ELEMENTS``) at ``PROBE_ROWS`` rows, both ways twice alternated, best of each; said in
    one line. A resumed run measures again: a different choice changes products by rounding."""
    key = tuple(tuple(layer.weight.shape) for layer in layers)
    if key not in _FLOAT32_PAYS:
        if sum(layer.weight.numel() for layer in layers) < MIN_FLOAT32_ELEMENTS:
            _FLOAT32_PAYS[key] = False
            return False
        probe, total = [], 0
        for layer in layers:
            if total >= PROBE_ELEMENTS:
                break
            probe.append(layer)
            total += layer.weight.numel()
        packed = [_pack(layer, torch.float32) for layer in probe]
        gen = torch.Generator().manual_seed(0)
        inputs = {
            k: torch.randn(PROBE_ROWS, k, generator=gen) for k in {m.in_features for m in probe}
        }
        plain = min(_time_products(probe, None, inputs) for _ in range(2))
        fast = min(_time_products(probe, packed, inputs) for _ in range(2))
        pays = plain >= MIN_GAIN * fast
        _FLOAT32_PAYS[key] = pays
        print(
            f"rollout: float32 products {'on packed weights' if pays else 'through F.linear'} "
            f"(oneDNN's packed {fast * 1e3:.0f} ms against F.linear's {plain * 1e3:.0f} ms "
            f"over {len(probe)} layers at {PROBE_ROWS} rows on this CPU)",
            file=sys.stderr,
            flush=True,
        )
    return _FLOAT32_PAYS[key]


def _packing_dtype(layers: list[nn.Linear], float32: bool) -> torch.dtype | None:
    """The dtype the session's products are packed in, or None: not packed."""
    elements: collections.Counter[torch.dtype] = collections.Counter()
    for layer in layers:
        elements[compute_dtype(layer)] += layer.weight.numel()
    if not elements:
        return None
    dtype = elements.most_common(1)[0][0]  # a float32 adapter on a bf16 model is not its dtype
    if dtype == torch.bfloat16:
        return dtype if _kernels(dtype) else None
    if dtype == torch.float32 and float32 and _kernels(dtype):
        same = [layer for layer in layers if compute_dtype(layer) == dtype]
        return dtype if float32_packing_pays(same) else None
    return None


@contextlib.contextmanager
def packed_linears(model: nn.Module, float32: bool = False) -> Iterator[None]:
    """While sampling on the CPU, every plain ``nn.Linear`` of ``model`` that multiplies in the
    model's dtype multiplies by its weight packed once, not as it is: in bf16 (autocast or bf16
    weights) wherever oneDNN has the kernels, in float32 with ``float32`` where it pays
    (``rollout.pack_float32``).

    Layers in another dtype (a float32 LoRA adapter on a bf16 model) and layers whose forward is
    already replaced (accelerate's hooks, a nested session) run as they are."""
    layers = [m for m in model.modules() if _packable(m)]
    dtype = _packing_dtype(layers, float32)
    if dtype is None:
        yield
        return
    patched = []
    try:
        for module in layers:
            if compute_dtype(module) != dtype:
                continue
            weight, bias = _pack(module, dtype)
            module.forward = functools.partial(_packed_linear, module, dtype, weight, bias)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
