"""A tiny random Gemma 3: sliding-window layers between full-attention ones (a test's model)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_gemma3(window: int, layers: int = 2) -> nn.Module:
    """``layers`` layers alternating a ``window``-token sliding window and full attention,
    sdpa attention, seeded weights, in eval mode."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        attn_implementation="sdpa",
    )
    return Gemma3ForCausalLM(config).eval()
