"""Loading a model and its tokenizer, making them the policy the config asks for, and saving them
as a plain Hugging Face folder."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from grpo.config import ModelConfig
from grpo.models.cache import ModelError
from grpo.models.lora import add_lora, is_lora
from grpo.scoring.prefix_attention import use_prefix_attention


@contextlib.contextmanager
def _loading(path: str) -> Iterator[None]:
    """transformers' OSError (e.g. a hub id that does not exist) as one line, not a traceback."""
    try:
        yield
    except OSError as err:
        raise ModelError(f"model '{path}': {str(err).splitlines()[0]}") from None


def mlp_shape(source: str | PretrainedConfig) -> tuple[int, int]:
    """(hidden, intermediate) of a decoder layer's MLP products, from a model folder or hub id,
    or a loaded model's config (an MLP without an ``intermediate_size``, GPT-2's, is 4 x
    hidden)."""
    from transformers import AutoConfig

    if isinstance(source, str):
        with _loading(source):
            source = AutoConfig.from_pretrained(source)
    config = getattr(source, "text_config", None) or source  # a multimodal model's decoder
    hidden = config.hidden_size
    return hidden, getattr(config, "intermediate_size", None) or 4 * hidden


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    with _loading(path):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding (prompts end where generation starts), and a pad token (EOS when none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(config: ModelConfig, path: str) -> nn.Module:
    """The trainable policy: full weights, or LoRA adapters on a frozen base."""
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    with _loading(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return prepare_policy(model, config)


def prepare_policy(model: nn.Module, config: ModelConfig) -> nn.Module:
    """A loaded model made the policy ``model.*`` asks for (also one a caller loaded itself)."""
    use_prefix_attention(model)  # packed groups skip their masked-out attention (SDPA otherwise)
    if config.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.config.use_cache = False
    if config.lora.enabled:
        model = add_lora(model, config)
    if config.disable_dropout:
        disable_dropout(model)
    return model


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout: ``nn.Dropout`` modules and the attention dropout rate that HF attention
    layers keep as a float (``attention_dropout``) and apply only in training mode."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def save_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """Save a plain HF folder; a LoRA policy is saved merged so any HF loader can read it."""
    path.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(path)
        model.save_pretrained(path / "adapter")
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
