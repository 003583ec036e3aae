"""GGUF files de-quantised into plain float32 Hugging Face folders, cached by file."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.models.cache import cache_root


def dequantize_gguf(gguf: Path, target: Path) -> Path:
    """Unpack a GGUF file into a plain float32 HF folder (weights, tokenizer, chat template)."""
    from transformers import GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def gguf_cache_folder(gguf: Path) -> Path:
    """Where a GGUF file's dequantized HF folder is cached: keyed by its path, size and mtime,
    so an edited or replaced file is converted again."""
    import hashlib

    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_root() / f"gguf-{gguf.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
