"""One decode step of a Llama-family model without transformers' per-call machinery.

A rollout's decode step runs the whole model for one token per row: on SmolLM2-135M, 30 layers
whose products are small, where the Python around them (the decorators and keyword plumbing of
every layer and attention call, the interface look-ups, the output containers) costs a tenth or
more of the step (docs/results/levers.md). ``lean_step`` runs the same computation as the model's
own forward, in the same order, through the model's own modules (projections, norms, MLP, rotary
embedding), mask function, rotary function and attention interface, and so gives the same logits
bit for bit (tested). It only replaces the glue between them.

It takes exactly the model classes whose forward it mirrors (``LEAN_MODELS``: Llama, Mistral,
Qwen2, Qwen3), also inside PEFT's LoRA wrapper (whose forward only calls the model within; the
adapted projections are called as modules, so they run their adapters), with every layer on full
attention and no hook or replaced forward on any module whose forward it skips; any other model
decodes through its own forward (``decode_step``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import Cache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# transformers 5.20 renamed the cache argument (the old name still works there, with a warning);
# vLLM's CPU build pins transformers < 5.20, where an unknown name would silently drop the cache
CACHE_ARG = "cache" if Version(transformers.__version__) >= Version("5.20") else "past_key_values"


class Mirrored(NamedTuple):
    """What ``lean_step`` needs to know of a model class whose decode forward it mirrors."""

    base: str  # the class of its decoder model (``model.model``)
    head_norms: bool  # its attention normalises each query and key head (Qwen3's q_norm, k_norm)
    window: Callable[[nn.Module, Any], int | None]  # (attention, config) -> the window it passes


def _own_window(attn: nn.Module, config: Any) -> int | None:
    return getattr(attn, "sliding_window", None)


def _config_window(attn: nn.Module, config: Any) -> int | None:
    return getattr(config, "sliding_window", None)


# causal LM class -> what its forward does that lean_step mirrors (transformers 5)
LEAN_MODELS = {
    "LlamaForCausalLM": Mirrored("LlamaModel", False, _own_window),
    "MistralForCausalLM": Mirrored("MistralModel", False, _config_window),
    "Qwen2ForCausalLM": Mirrored("Qwen2Model", False, _own_window),
    "Qwen3ForCausalLM": Mirrored("Qwen3Model", True, _own_window),
}

# a decode step: (next tokens [b], attention mask [b, S], positions [b, 1], cache) -> logits [b, V]
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Cache], torch.Tensor]


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` does more than its class's forward (hooks, an instance
    forward such as accelerate's): skipping its call would skip that too."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or "forward" in vars(module)
        or (getattr(module, "gradient_checkpointing", False) and module.training)
    )


def _global_hooks() -> bool:
    """Whether forward hooks are registered for every module
    (``register_module_forward_hook``): they would miss the calls lean_step skips."""
    from torch.nn.modules import module

    names = ("_global_forward_hooks", "_global_forward_pre_hooks")
    return any(getattr(module, name, None) for name in names)


def unwrapped(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """The transformers model whose forward ``model``'s ends in, and the wrappers around it: a
    PEFT LoRA model's forward passes its call through two of them unchanged (``PeftModel``,
    ``LoraModel``); any other PEFT method changes the call (prompt learning adds tokens,
    activated LoRA offsets), so its model is not unwrapped (and so not leanable)."""
    if not type(model).__module__.startswith("peft."):
        return model, []
    config = getattr(model, "active_peft_config", None)
    tuner = getattr(model, "base_model", None)
    if (
        config is None
        or config.peft_type != "LORA"  # a str enum
        or getattr(config, "alora_invocation_tokens", None) is not None
        or not isinstance(getattr(tuner, "model", None), nn.Module)
    ):
        return model, []
    return tuner.model, [model, tuner]


def leanable(model: nn.Module) -> bool:
    """Whether ``lean_step`` computes ``model``'s own decode forward."""
    model, wrappers = unwrapped(model)
    mirrored = LEAN_MODELS.get(type(model).__name__)
    base = getattr(model, "model", None)
    if mirrored is None or mirrored.base != type(base).__name__:
        return False
    if not type(model).__module__.startswith("transformers.models."):
        return False  # custom code (trust_remote_code) under a transformers class name
    config = model.config
    layers = list(base.layers)
    if len(layers) != config.num_hidden_layers:
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    skipped = [*wrappers, model, base, *layers, *(layer.self_attn for layer in layers)]
    if _global_hooks() or any(_hooked(m) for m in skipped):
        return False
    return all(mirrored.window(layer.self_attn, config) is None for layer in layers)


def lean_step(model: nn.Module) -> DecodeStep:
    """``model``'s decode forward (see the module docstring); ``leanable(model)`` must hold."""
    model, _ = unwrapped(model)
    base = model.model
    config = model.config
    modeling = sys.modules[type(model).__module__]
    rotate, eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward
    head_norms = LEAN_MODELS[type(model).__name__].head_norms

    def step(
        tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
        hidden = base.embed_tokens(tokens[:, None])
        causal = create_causal_mask(
            config=config,
            inputs_embeds=hidden,
            attention_mask=mask,
            position_ids=positions,
            **{CACHE_ARG: cache},
        )
        cos, sin = base.rotary_emb(hidden, position_ids=positions)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            if head_norms:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = rotate(q, k, cos, sin)
            k, v = cache.update(k, v, i)
            dropout = attn.attention_dropout if attn.training else 0.0
            # every window is None here (``leanable``): what Qwen and Mistral pass, Llama's default
            out, _ = attend(
                attn, q, k, v, causal, dropout=dropout, scaling=attn.scaling, sliding_window=None
            )
            hidden = hidden + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return model.lm_head(base.norm(hidden))[:, -1].float()

    return step


def own_step(model: nn.Module) -> DecodeStep:
    """A decode step through ``model``'s own forward."""

    def step(
        tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
        out = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=positions,
            **{CACHE_ARG: cache},
            use_cache=True,
        )
        return out.logits[:, -1].float()

    return step


def _crop_to(cache: Cache, length: int) -> None:
    """Every layer of ``cache`` back to ``length`` positions (a failed step may have written
    some layers only; transformers' ``crop`` takes tokens to remove, not a length)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


# model -> whether lean_step gave its own forward's logits bit for bit at its first decode step
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def decode_step(model: nn.Module) -> DecodeStep:
    """The decode step for ``model``: ``lean_step`` where it applies, else its own forward.

    The first step of each model runs both on the same cache and compares their logits, so a
    transformers version whose forward differs from what ``lean_step`` mirrors is caught at
    once: it is said in one line and the model keeps its own forward."""
    own = own_step(model)
    if not leanable(model):
        return own
    lean = lean_step(model)

    def step(
        tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
        verified = _VERIFIED.get(model)
        if verified is not None:
            return (lean if verified else own)(tokens, mask, positions, cache)
        length = cache.get_seq_length()
        try:
            got = lean(tokens, mask, positions, cache)
        except Exception as error:  # an API this transformers version does not have
            got, why = None, f"{type(error).__name__}: {error}"
        _crop_to(cache, length)  # the model's own forward writes this token's keys and values
        expected = own(tokens, mask, positions, cache)
        if got is not None:
            why = f"max |diff| {(got - expected).abs().max().item():.2e}"
        # bit for bit, NaN where the model's own has NaN (a diverged model is no mismatch)
        same = got is not None and torch.allclose(got, expected, rtol=0, atol=0, equal_nan=True)
        _VERIFIED[model] = same
        if not same:
            print(
                f"rollout: the lean decode step differs from {type(model).__name__}'s forward "
                f"(transformers {transformers.__version__}, {why}); decoding through the "
                "model's own",
                file=sys.stderr,
                flush=True,
            )
        return expected

    return step
