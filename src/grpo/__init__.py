"""grpo: Group Relative Policy Optimization and its family for Hugging Face language models.

Importing it changes nothing in the process: settings a run needs (kernel cache bounds, threads,
malloc policy) are applied when a run starts (``grpo.build.prepare_process``).
"""

from typing import TYPE_CHECKING, Any

from grpo.config import Config, load_config

if TYPE_CHECKING:
    from grpo.training import Trainer, train

__all__ = ["Config", "Trainer", "load_config", "train"]


def __getattr__(name: str) -> Any:
    # torch and transformers load with the trainer, when a run needs it, not on `import grpo`
    if name in ("Trainer", "train"):
        import grpo.training

        return getattr(grpo.training, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
