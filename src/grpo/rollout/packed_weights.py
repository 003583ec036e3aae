"""Sampling's linear layers on weights packed once into oneDNN's blocked layout.

``F.linear`` takes a weight as it is at every call, and the CPU library behind it lays panels of
it out afresh for each product. A decode step's products have few rows, so that re-layout is a
large part of each one: on SmolLM2's shapes at 32 rows a packed bf16 weight takes 0.6-0.8x the
time, and on an AMD EPYC a packed float32 one 0.61x MKL's (docs/results/rollout-speed.md).
Packing costs one reorder of each weight per sampling session (a rollout, or evaluation's
batches) and holds the packed copy while sampling (in float32, a second copy of every linear
weight: 540 MB for SmolLM2).

bf16 products are packed wherever oneDNN has bf16 kernels: they are the same bf16 products bit
for bit at SmolLM2's widths, with and without bias (tested). Float32 products are packed only when
asked (``rollout.pack_float32``, after measuring this CPU with the rollout-speed benchmark):
oneDNN's kernels sum in another order than MKL's, so a packed float32 product differs from
``F.linear``'s by rounding; through SmolLM2's 30 layers that moves sampled log-probs by up to
5e-5, and a few completions take another token where two were close (counted by the
benchmark). Unasked, float32 sampling keeps ``F.linear``'s products bit for bit. The choice is
the config's, never a timing's, so every process of a run (a resume, a producer, a server)
multiplies alike.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn


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


def _packing_dtype(layers: list[nn.Linear], float32: bool) -> torch.dtype | None:
    """The dtype the session's products are packed in, or None: not packed."""
    elements: collections.Counter[torch.dtype] = collections.Counter()
    for layer in layers:
        elements[compute_dtype(layer)] += layer.weight.numel()
    if not elements:
        return None
    dtype = elements.most_common(1)[0][0]  # a float32 adapter on a bf16 model is not its dtype
    if dtype == torch.bfloat16 or (dtype == torch.float32 and float32):
        return dtype if _kernels(dtype) else None
    return None


def why_float32_unpacked(model: nn.Module) -> str | None:
    """Why ``rollout.pack_float32`` would pack nothing of ``model``, or None where it packs."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"the model samples on {device.type}; packing is for CPU products"
    if not _kernels(torch.float32):
        return "this torch build has no oneDNN packed-weight ops"
    return None


@contextlib.contextmanager
def packed_linears(model: nn.Module, float32: bool = False) -> Iterator[None]:
    """While sampling on the CPU, every plain ``nn.Linear`` of ``model`` that multiplies in the
    model's dtype multiplies by its weight packed once, not as it is: in bf16 (autocast or bf16
    weights) wherever oneDNN has the kernels, in float32 only with ``float32``
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
