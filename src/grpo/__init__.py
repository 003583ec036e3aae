"""grpo: Group Relative Policy Optimization and its family for Hugging Face language models.

Importing it changes nothing in the process: settings a run needs (kernel cache bounds, threads,
malloc policy) are applied when a run starts (``grpo.build.prepare_process``).
"""

from grpo.config import Config, load_config
from grpo.training import Trainer, train

__all__ = ["Config", "Trainer", "load_config", "train"]
