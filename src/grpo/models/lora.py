"""LoRA: adapters on a frozen base (``model.lora``), through peft."""

from __future__ import annotations

from torch import nn

from grpo.config import ModelConfig


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def add_lora(model: nn.Module, config: ModelConfig) -> nn.Module:
    """``model`` with LoRA adapters (``model.lora``) on its frozen weights."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    lora = PeftLoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if config.gradient_checkpointing:
        model.enable_input_require_grads()
    return model
