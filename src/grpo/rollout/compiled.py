"""A decode step compiled once by torch.compile (inductor): ``lean_step``'s computation with the
Python and the small ops between the products fused away.

An eager decode step of SmolLM2-135M at 32 rows is mostly not its products: 30 layers of norms,
rotary embeddings, casts, cache writes and the calls around them, each a dispatch of its own
(docs/results/rollout-speed.md). Compiled, the elementwise work of a layer becomes a few C++
loops and only the products (``F.linear``, external calls into oneDNN/MKL) stay as they were.

What changes against the eager step, so that one compilation serves every rollout:

- the weights are arguments, not the modules' own: cast to the sampling dtype once per rollout
  (bf16 under autocast: a copy of every linear weight while sampling, where the eager step
  casts each weight at every product), the model's own tensors in float32;
- the KV cache is the reserved buffers of ``ReservedLayer``, written in place at the token's
  position; attention reads their filled part, the prompt's padding masked;
- shapes are dynamic (rows leave the batch, prompts differ in length), so one graph is traced
  per model and its kernels are cached on disk by inductor across runs: in ``KERNEL_CACHE``
  (``~/.cache/grpo/inductor``) unless ``TORCHINDUCTOR_CACHE_DIR`` names another folder, so
  that they outlive a ``/tmp`` cleared at boot (inductor's default);
- on a GPU (``GRAPHED_DEVICES``) the step is replayed as a captured CUDA graph, whose shapes
  and addresses are fixed: there every row stays in the batch, attention reads the whole
  reserved cache (a power of two of positions, masked past the token), and the decode cache's
  buffers and the weights' cast copy are kept from one rollout to the next (``graphed``).

Compiled kernels sum in other orders than the eager ones, so the logits differ by rounding (a
float32 rollout's tokens are then no longer bit for bit the model's own forward's); and the first
rollout of a machine waits for the compilation (120-170 s on a 2-core AMX Xeon, and about a
minute in a later process that finds the kernels on disk, where the step it compiles runs
1.0-1.4x the eager one: docs/results/rollout-speed.md). So it is asked for
(``rollout.compile: true``), never the default. The first step of each model is computed both
ways and compared; a compiled step that is further from the model's own forward than rounding
explains (a transformers version whose forward does something ``lean_step`` does not mirror) is
said in one line and the model decodes eagerly, as does one whose compilation fails (no C++
compiler, an unsupported op).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from transformers import Cache

from grpo.rollout.decode import LEAN_MODELS, DecodeStep, decode_step, leanable, own_step
from grpo.rollout.kv_cache import BufferPool, ReservedLayer
from grpo.runtime.user_code import error_line

# log-probs of the first step, compiled against the model's own forward: bf16 rounding moves
# them by a few hundredths of a nat on SmolLM2; a mirroring error (a missing bias, another rotary
# embedding) by whole nats
AGREEMENT_NATS = 0.5


class Linear(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor | None


class LayerWeights(NamedTuple):
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate: Linear
    up: Linear
    down: Linear


class Weights(NamedTuple):
    """A model's linear weights in the dtype a rollout multiplies in."""

    layers: list[LayerWeights]
    head: Linear


PROJECTIONS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def compilable(model: nn.Module) -> bool:
    """Whether ``compiled_step`` computes ``model``'s decode step: a model ``lean_step``
    mirrors, whose projections and head are plain linear layers (no LoRA, no quantisation)."""
    if not leanable(model) or type(model).__module__.startswith("peft."):
        return False
    layers = model.model.layers
    modules = [layer.get_submodule(p) for layer in layers for p in PROJECTIONS.values()]
    return all(type(m) is nn.Linear for m in [*modules, model.lm_head])


def _linear(module: nn.Linear, dtype: torch.dtype) -> Linear:
    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().to(dtype)

    return Linear(cast(module.weight), cast(module.bias))


def weights(model: nn.Module, dtype: torch.dtype) -> Weights:
    """``model``'s projections and head in ``dtype`` (its own tensors where already so)."""
    return Weights(
        [
            LayerWeights(
                **{n: _linear(layer.get_submodule(p), dtype) for n, p in PROJECTIONS.items()}
            )
            for layer in model.model.layers
        ],
        _linear(model.lm_head, dtype),
    )


def _traced(model: nn.Module) -> Callable[..., torch.Tensor]:
    """The step that torch.compile traces: ``lean_step`` with given weights and buffers."""
    base, config = model.model, model.config
    modeling = sys.modules[type(model).__module__]
    rotate = modeling.apply_rotary_pos_emb
    head_norms = LEAN_MODELS[type(model).__name__].head_norms
    kv_heads = config.num_key_value_heads

    def project(x: torch.Tensor, linear: Linear) -> torch.Tensor:
        return F.linear(x, linear.weight, linear.bias)

    def step(
        tokens: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        at: torch.Tensor,
        w: Weights,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        # the positions attention reads: those written, this token's included (at + 1), or
        # with static shapes the whole buffer, where the ones past this token are masked
        span = allowed.shape[-1]
        visible = allowed & (torch.arange(span, device=allowed.device) <= at)
        masked = ~visible[:, None, None, :]  # [b, 1, 1, span]
        hidden = base.embed_tokens(tokens[:, None])
        cos, sin = base.rotary_emb(hidden, position_ids=positions)
        for i, layer in enumerate(base.layers):
            attn, lw = layer.self_attn, w.layers[i]
            x = layer.input_layernorm(hidden)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q, k = project(x, lw.q).view(shape), project(x, lw.k).view(shape)
            if head_norms:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = project(x, lw.v).view(shape).transpose(1, 2)
            q, k = rotate(q, k, cos, sin)
            keys[i].index_copy_(2, at, k.to(keys[i].dtype))
            values[i].index_copy_(2, at, v.to(values[i].dtype))
            # one query per row: each key head's group of query heads against the filled part
            held_k, held_v = keys[i][:, :, :span], values[i][:, :, :span]
            rows, heads = q.shape[0], q.shape[1]
            grouped = q.reshape(rows, kv_heads, heads // kv_heads, attn.head_dim)
            scores = grouped @ held_k.to(q.dtype).transpose(-1, -2) * attn.scaling
            # masked, not added: a stale key past the token may overflow its score to inf
            scores = scores.masked_fill(masked, -torch.inf)
            p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = (p @ held_v.to(q.dtype)).reshape(rows, 1, heads * attn.head_dim)
            hidden = hidden + project(out, lw.o)
            x = layer.post_attention_layernorm(hidden)
            mlp = layer.mlp
            hidden = hidden + project(mlp.act_fn(project(x, lw.gate)) * project(x, lw.up), lw.down)
        return project(base.norm(hidden), w.head)[:, -1].float()

    return step


KERNEL_CACHE = Path.home() / ".cache" / "grpo" / "inductor"


# devices where the compiled step is replayed as a captured CUDA graph (torch.compile's
# "reduce-overhead"): a decode step of a small model there is hundreds of kernel launches of a
# few microseconds' work each, which a graph replays in one launch. A graph replays fixed
# shapes at fixed addresses, so there the step's shapes are made static (``graphed``)
GRAPHED_DEVICES = {"cuda"}

# with static shapes the KV cache reserves a power of two of positions, at least this many, so
# that rollouts of nearby lengths share one captured graph
GRAPHED_POSITIONS = 64


class _Compiled:
    """A model's compiled step, or None once it decodes eagerly (said once), and the dtypes
    whose first step was checked against the model's own forward; replayed as CUDA graphs
    (``graphs``), with the weights and KV-cache buffers it reads kept at fixed addresses."""

    def __init__(self, model: nn.Module, graphs: bool) -> None:
        _use_kernel_cache()
        # graphs: static shapes first; a later size recompiles with that dimension dynamic, and
        # each size then gets its own captured graph
        options: dict[str, Any] = (
            {"mode": "reduce-overhead", "dynamic": None} if graphs else {"dynamic": True}
        )
        if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
            # every model's step is the same code object, whose recompilations dynamo would
            # otherwise count together (8 at most, then a fullgraph step fails)
            options["isolate_recompiles"] = True
        self.step: Callable[..., torch.Tensor] | None = torch.compile(
            _traced(model), fullgraph=True, **options
        )
        self.graphs = graphs
        self.checked: set[torch.dtype] = set()
        self.weights: dict[torch.dtype, Weights] = {}  # graphs: the cast copies, refreshed
        self.buffers = BufferPool(torch._dynamo.mark_static_address)


def _use_kernel_cache() -> None:
    """Inductor's kernels go to ``KERNEL_CACHE`` unless the user named a folder. Inductor writes
    its own default (``/tmp/torchinductor_<user>``) into ``TORCHINDUCTOR_CACHE_DIR`` the first
    time anything asks it for the folder (importing peft does), so that value counts as unnamed,
    even where a user named that very folder; the variable is read again at each compilation,
    so setting it now still holds."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without the module: only an unset variable counts as unnamed
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(KERNEL_CACHE))
        return
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named is None or os.path.abspath(named) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(KERNEL_CACHE)


# model -> its compiled step (one trace per model and process; kernels cached on disk)
_COMPILED: weakref.WeakKeyDictionary[nn.Module, _Compiled] = weakref.WeakKeyDictionary()


def _entry(model: nn.Module) -> _Compiled:
    if model not in _COMPILED:
        device = next(model.parameters()).device.type
        _COMPILED[model] = _Compiled(model, graphs=device in GRAPHED_DEVICES)
    return _COMPILED[model]


def linears(w: Weights) -> list[Linear]:
    """Every projection of ``w`` in model order, the head last."""
    return [*(linear for layer in w.layers for linear in layer), w.head]


def _tensors(w: Weights) -> list[torch.Tensor]:
    return [t for linear in linears(w) for t in linear if t is not None]


def _held_weights(entry: _Compiled, model: nn.Module, dtype: torch.dtype) -> Weights:
    """``weights(model, dtype)``; for a graphed step at the same addresses every rollout: the
    model's own tensors where they are in ``dtype`` (the optimizer updates them in place), else
    a cast copy kept per dtype and refreshed in place, so that the graph reads this rollout's
    weights where it recorded them."""
    if not entry.graphs:
        return weights(model, dtype)
    own = weights(model, next(model.parameters()).dtype)
    held = own if own.head.weight.dtype == dtype else entry.weights.get(dtype)
    if held is None:
        held = entry.weights[dtype] = weights(model, dtype)
    elif held is not own:
        for mine, now in zip(_tensors(held), _tensors(own), strict=True):
            mine.copy_(now)
    for t in _tensors(held):
        torch._dynamo.mark_static_address(t)
    return held


def graphed(setting: bool, model: nn.Module) -> bool:
    """Whether a rollout of ``model`` decodes through captured CUDA graphs (``wanted``, on a
    device of ``GRAPHED_DEVICES``): its shapes are then static, so no row leaves the batch
    and the KV cache comes from the step's ``BufferPool``, sized by ``graphed_capacity``."""
    return wanted(setting, model) and _entry(model).graphs


def graphed_capacity(positions: int) -> int:
    """The KV-cache positions a graphed rollout reserves for ``positions``."""
    return max(GRAPHED_POSITIONS, 1 << (positions - 1).bit_length())


def buffer_pool(model: nn.Module) -> BufferPool:
    """The KV-cache buffers of ``model``'s graphed step."""
    return _entry(model).buffers


def compiled_step(model: nn.Module, dtype: torch.dtype) -> DecodeStep:
    """``model``'s decode step compiled (``compilable(model)`` must hold), over its weights cast
    to ``dtype`` now (call it once per rollout: the weights change between rollouts)."""
    entry = _entry(model)
    if entry.step is None:  # compiling failed: the step it decodes through without compile
        return decode_step(model)
    eager = functools.cache(lambda: decode_step(model))  # for a failure in this rollout
    own = own_step(model)
    w = _held_weights(entry, model, dtype)

    def step(
        tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
        if entry.step is None:
            return eager()(tokens, mask, positions, cache)
        layers: list[ReservedLayer] = cache.layers  # type: ignore[assignment]
        if entry.graphs and not entry.buffers.lent_to(cache):  # its buffers hold another's keys
            raise RuntimeError(
                f"rollout.compile: another rollout of {type(model).__name__} took its CUDA "
                "graphs' KV cache while this one decoded (one rollout at a time per model)"
            )
        at = layers[0].length
        for layer in layers:
            if at + 1 > layer.key_buffer.shape[2]:  # as ReservedLayer.update grows
                layer._reserve(layer.keys, layer.values, 2 * layer.key_buffer.shape[2])
        # [b, span]: the prompt's padding is not attended; a graph reads the whole buffer
        span = layers[0].key_buffer.shape[2] if entry.graphs else at + 1
        allowed = torch.cat(
            [mask.bool(), mask.new_ones(len(mask), span - mask.shape[1], dtype=torch.bool)], 1
        )
        args = (
            tokens,
            positions,
            allowed,
            torch.tensor([at], device=mask.device),
            w,
            [layer.key_buffer for layer in layers],
            [layer.value_buffer for layer in layers],
        )
        start, skips = time.perf_counter(), counters["inductor"]["cudagraph_skips"]
        try:
            if entry.graphs:  # each step is a new replay, whose output is the graph's memory
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():  # a graph holding outputs for a backward would not replay
                got: torch.Tensor | None = entry.step(*args)
            if entry.graphs:
                got = got.clone()
            why = ""
        except Exception as error:  # no C++ compiler, an op inductor cannot lower (a recompile)
            got, why = None, error_line(error)
        if got is not None and dtype in entry.checked:
            for layer in layers:
                layer.length = at + 1
                layer._view()
            return got
        seconds = time.perf_counter() - start
        # the model's own forward writes this token's keys and values (over the compiled step's)
        expected = own(tokens, mask, positions, cache)
        if got is not None:
            gap = (got.log_softmax(-1) - expected.log_softmax(-1)).abs().max().item()
            if not gap <= AGREEMENT_NATS:  # NaN too
                got, why = None, f"max |log-prob diff| {gap:.2g} against its own forward"
        name = type(model).__name__
        if got is None:
            entry.step = None
            _say(f"{name} decodes eagerly ({why})")
        else:
            entry.checked.add(dtype)
            # inductor says why only in its perf_hints log, which is off by default
            ungraphed = entry.graphs and counters["inductor"]["cudagraph_skips"] > skips
            _say(
                f"{name}'s decode step compiled in {seconds:.0f} s"
                + (", without CUDA graphs (TORCH_LOGS=perf_hints says why)" if ungraphed else "")
            )
        return expected

    return step


def _say(what: str) -> None:
    print(f"rollout.compile: {what}", file=sys.stderr, flush=True)


def wanted(setting: bool, model: nn.Module) -> bool:
    """Whether a rollout of ``model`` decodes compiled (``rollout.compile``): not once its
    compilation has failed (its rollouts then decode, and pack their weights, as eager ones)."""
    entry = _COMPILED.get(model)
    return setting and compilable(model) and (entry is None or entry.step is not None)


def sampling_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model``'s products are in now: bf16 under bf16 autocast, else its own."""
    device = next(model.parameters()).device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
        return torch.bfloat16
    return next(model.parameters()).dtype


def decode_for(model: nn.Module, setting: bool, eager: Callable[[], DecodeStep]) -> Any:
    """The decode step of a rollout: compiled where ``wanted``, else ``eager()``."""
    if wanted(setting, model):
        return compiled_step(model, sampling_dtype(model))
    return eager()
