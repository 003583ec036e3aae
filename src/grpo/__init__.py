"""grpo: Group Relative Policy Optimization and its family for Hugging Face language models."""

from grpo.runtime.host_memory import bound_kernel_caches

bound_kernel_caches()  # before anything can run a bf16 product (see grpo/memory.py)

from grpo.config import Config, load_config  # noqa: E402
from grpo.training.trainer import Trainer, train  # noqa: E402

__all__ = ["Config", "Trainer", "load_config", "train"]
