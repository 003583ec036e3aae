"""The HF engine's KV cache: each full-attention layer writes into a buffer reserved for the
whole rollout instead of concatenating at every token, in the dtype attention multiplies in."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, DynamicLayer

from grpo.rollout.decode import LEAN_MODELS, unwrapped
from grpo.scoring.prefix_attention import PREFIX

# completion positions a rollout's KV cache holds from the start (beyond: it doubles), so a large
# max_new_tokens that completions rarely reach reserves no memory they do not use
RESERVED_TOKENS = 1024

# attention implementations whose products autocast casts in the models of LEAN_MODELS (SDPA,
# their eager function's matmuls; PREFIX is SDPA outside packed scoring): under autocast they
# multiply keys and values in its dtype, whatever dtype the cache holds them in. Another model's
# "eager" may turn autocast off and upcast its keys (Flint's does), so only these narrow
AUTOCAST_ATTENTION = {"sdpa", "eager", PREFIX}


class BufferPool:
    """Decode buffers kept from one rollout to the next, one per layer, role (keys or values),
    batch shape and dtype, so that the next rollout's cache is at the same addresses: what a
    captured CUDA graph needs, which replays its reads and writes where it recorded them
    (``grpo.rollout.compiled``). A buffer is only replaced by a larger one, when a rollout needs
    more positions than it holds: the pool holds one cache of the longest rollout so far, and a
    shorter one uses the front of it. A buffer is zeroed once, when made: the positions a rollout
    has not written hold an earlier rollout's numbers, never uninitialised memory. ``prepare``
    runs on each new buffer. One rollout at a time may use a pool: the cache it is lent to
    (``use_pool``) is the one whose decode steps may read it (``lent_to``)."""

    def __init__(self, prepare: Callable[[torch.Tensor], None]) -> None:
        self.prepare = prepare
        self.held: dict[tuple[Any, ...], torch.Tensor] = {}
        self.lent: weakref.ref[DynamicCache] | None = None

    def lent_to(self, cache: DynamicCache) -> bool:
        return self.lent is not None and self.lent() is cache

    def take(self, layer: int, role: str, like: torch.Tensor, capacity: int) -> torch.Tensor:
        """A [rows, heads, positions, dim] buffer of at least ``capacity`` positions for
        ``layer``'s ``role``, shaped and typed as ``like`` but for its positions."""
        rows, heads, _, dim = like.shape
        key = (layer, role, rows, heads, dim, like.dtype, like.device)
        buffer = self.held.get(key)
        if buffer is None or buffer.shape[2] < capacity:
            buffer = self.held[key] = like.new_zeros(rows, heads, capacity, dim)
            self.prepare(buffer)
        return buffer


def use_pool(cache: DynamicCache, pool: BufferPool) -> None:
    """The reserved layers of ``cache`` take their next buffers from ``pool`` (after a prefill:
    the prompts' own buffers are not kept), and the pool is lent to ``cache`` alone."""
    pool.lent = weakref.ref(cache)
    for layer in cache.layers:
        if isinstance(layer, ReservedLayer):
            layer.pool = pool


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a buffer reserved for the whole rollout.

    ``DynamicLayer`` concatenates at every token, copying the layer's whole cache each time, so
    a decode step moves the cache through memory three times (read and write to append, read to
    attend) where attending needs one read: quadratic traffic in the completion's length, and
    the cost of a decode step on a CPU whose memory bandwidth is its limit. Here each token
    writes only itself and attention reads a view of the filled part. Holds ``capacity``
    positions at first; a write past them doubles the buffer (at least), so growing costs a
    copy per doubling, not per token, and the buffer is never more than twice what it holds.

    ``attended``: the dtype attention multiplies in (bf16 under autocast, ``attended_dtype``),
    which the states are stored in where it is narrower than theirs. Under bf16 autocast the
    rotary embedding hands over float32 keys, and attention would cast the whole float32 cache
    to bf16 at every step: a read and a write of every key per layer and token. Stored in bf16 as written, each key is
    cast once, to the same bf16 numbers, so attention's output is unchanged bit for bit.

    ``pool`` (``use_pool``): where its buffers come from, as layer ``index``, else fresh ones.
    """

    def __init__(self, capacity: int, attended: torch.dtype | None = None, index: int = 0) -> None:
        super().__init__()
        self.capacity, self.attended, self.index = capacity, attended, index
        self.pool: BufferPool | None = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0  # after a reset too
        keys, values = (self._stored(x[:, :, :0]) for x in (key_states, value_states))
        self._reserve(keys, values, self.capacity)

    def _stored(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` in the dtype the buffers hold: only ever narrowed (a bf16 state under
        float16 autocast is cast by attention as it would be; widening would only cost memory)."""
        attended = self.attended
        if attended is None or states.element_size() <= attended.itemsize:
            return states
        return states.to(attended)

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Fresh buffers of ``capacity`` positions holding ``keys`` and ``values`` at the front.
        Only the filled part is ever copied: the rest is memory the rollout may never write (a
        reservation of 1024 tokens for completions of 20), whose pages stay untouched."""
        self.key_buffer = self._buffer("keys", keys, capacity)
        self.value_buffer = self._buffer("values", values, capacity)
        self.key_buffer[:, :, : keys.shape[2]] = keys
        self.value_buffer[:, :, : values.shape[2]] = values
        self.length = keys.shape[2]
        self._view()

    def _buffer(self, role: str, like: torch.Tensor, capacity: int) -> torch.Tensor:
        if self.pool is None:
            return like.new_empty(*like.shape[:2], capacity, like.shape[-1])
        return self.pool.take(self.index, role, like, capacity)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        held = self.key_buffer.shape[-2]
        if end > held:
            self._reserve(self.keys, self.values, max(end, 2 * held))
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def _view(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # checks the argument, as DynamicLayer's callers expect
        if self.is_initialized:
            self.length = self.keys.shape[-2]
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            rows = torch.arange(self.keys.shape[0], device=self.keys.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            held = self.key_buffer.shape[-2]
            self._reserve(self.keys[indices], self.values[indices], held)


def attended_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``model``'s attention multiplies keys and values in now, where autocast decides
    it (a transformers model of ``LEAN_MODELS``, also inside PEFT's LoRA wrapper, on one of
    ``AUTOCAST_ATTENTION``), else None: as they come."""
    inner, _ = unwrapped(model)
    device = next(model.parameters()).device.type
    implementation = getattr(inner.config, "_attn_implementation", None)
    known = type(inner).__name__ in LEAN_MODELS and type(inner).__module__.startswith(
        "transformers.models."  # not custom code under a transformers class name
    )
    if known and implementation in AUTOCAST_ATTENTION and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def reserved_cache(model: nn.Module, capacity: int) -> DynamicCache:
    """The model's ``DynamicCache`` with each full-attention layer reserving ``capacity``
    positions in the dtype its attention multiplies in (``attended_dtype``, decided now: a
    rollout keeps one autocast state throughout); sliding-window and other special layers keep
    their own behaviour."""
    cache = DynamicCache(config=model.config)
    dtype = attended_dtype(model)
    cache.layers = [
        ReservedLayer(capacity, dtype, i) if type(layer) is DynamicLayer else layer
        for i, layer in enumerate(cache.layers)
    ]
    return cache
