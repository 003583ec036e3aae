"""The LM head's matrix products in bounded memory, for ``grpo.scoring.chunked_head``.

Full-vocabulary logits are the largest tensors a scoring pass makes ([positions, V]: 283 MiB
in float32 for a 32-completion SmolLM2 step), and a bf16 product's temporaries of that size
come as fresh pages every time. Here: the float32 buffer logits are computed in
(``logits_buffer``, ``logits_into``), every position's logits in it a block at a time under
bf16 (``kept_logits``), a spent buffer narrowed to bf16 in its own memory (``narrowed``), and
the head's weight gradient added a block of rows at a time (``add_product_``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

# bytes of one block of the head's weight gradient made by one product in a lower precision:
# its result and oneDNN's float32 accumulator (6 bytes a value) stay under ``train.malloc:
# keep``'s 16 MiB mmap threshold, so they reuse heap memory rather than come as fresh pages
PRODUCT_BLOCK_BYTES = 8 << 20

# positions of one product of kept logits under bf16 (``kept_logits``): each block reads the
# whole head weight, so a 151,936 x 896 head (Qwen2.5-0.5B) over 1024 positions took 1.42x the
# one product's time in blocks of 27 rows, 1.19x in 64, 1.07x in 128 (one-off probe, AMD
# EPYC); a block's bf16 result is then 12 MiB on SmolLM2's vocabulary, 37 MiB on Qwen's
HEAD_BLOCK_ROWS = 128


def add_product_(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` ([V, c] @ [c, H] into [V, H]).

    float32 operands, or any device but the CPU: one ``addmm_`` in ``out``'s dtype, no
    temporary. bf16 operands on the CPU (under autocast): one product per block of ``out``'s
    rows, each added into ``out``; a single product would make [V, H] temporaries (its float32
    accumulator, its result: 162 MiB on SmolLM2 by arithmetic) that come as fresh pages every
    chunk. Each block of each chunk is rounded to bf16 once before it is added: a rounding per
    64-row chunk, where autocast rounds a layer's weight gradient once per product.
    """
    if a.dtype == torch.float32 or out.device.type != "cpu":
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
        return
    rows = max(1, PRODUCT_BLOCK_BYTES // (6 * b.shape[1]))
    for lo in range(0, out.shape[0], rows):
        out[lo : lo + rows].add_(a[lo : lo + rows] @ b)


def logits_buffer(hidden: Tensor, weight: Tensor, chunk: int) -> Tensor:
    """The float32 [chunk, V] buffer the plain chunked head computes each chunk's logits in."""
    rows = min(chunk, hidden.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=torch.float32, device=hidden.device)


def logits_into(buffer: Tensor, h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """The logits of hidden states ``h`` [c, H] under head ``w``, ``b``, in ``buffer[:c]``: the
    product writes there when it runs in float32, else its result is copied in."""
    out = buffer[: h.shape[0]]
    if w.dtype != out.dtype:
        return out.copy_(F.linear(h.to(w.dtype), w, b))
    h = h.to(w.dtype)
    return torch.mm(h, w.T, out=out) if b is None else torch.addmm(b, h, w.T, out=out)


def kept_logits(hidden: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """Every position's logits ([M, V] float32) in one buffer: a float32 head's one product
    writes there; a bf16 head's products are copied in ``HEAD_BLOCK_ROWS`` rows at a time, so
    no second [M, V] tensor is made (141 MiB in bf16 for a 32-completion SmolLM2 step)."""
    buffer = logits_buffer(hidden, w, hidden.shape[0])
    if w.dtype == buffer.dtype:
        return logits_into(buffer, hidden, w, b)
    for lo in range(0, hidden.shape[0], HEAD_BLOCK_ROWS):
        hi = lo + HEAD_BLOCK_ROWS
        logits_into(buffer[lo:hi], hidden[lo:hi], w, b)
    return buffer


def narrowed(buffer: Tensor, dtype: torch.dtype) -> Tensor:
    """``buffer`` ([c, V] float32, contiguous, spent) in ``dtype``. A dtype of half its size (a
    bf16 product's operand) is written into the front half of ``buffer``'s own memory a block
    of rows at a time, with no second [c, V] tensor (``.to``'s fresh pages: 141 MiB for kept
    SmolLM2 logits). Row r of the result takes half of float32 row r // 2's bytes, a row at or
    before it; each block is cast into a temporary before it is written, so every row it
    writes over, its own or an earlier block's, has been read. Any other dtype is ``.to``'s
    (``buffer`` itself for its own)."""
    if buffer.element_size() != 2 * dtype.itemsize:
        return buffer.to(dtype)
    out = buffer.view(-1).view(dtype)[: buffer.numel()].view(buffer.shape)
    rows = max(1, PRODUCT_BLOCK_BYTES // (buffer.element_size() * buffer.shape[1]))
    for lo in range(0, buffer.shape[0], rows):
        out[lo : lo + rows] = buffer[lo : lo + rows].to(dtype)
    return out
