"""grpo: Group Relative Policy Optimization and its family for Hugging Face language models."""

from grpo.config import Config, load_config
from grpo.trainer import Trainer, train

__all__ = ["Config", "Trainer", "load_config", "train"]
