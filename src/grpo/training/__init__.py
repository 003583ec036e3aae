"""Training: the loop (``trainer``) and the modules it wires.

The trainer (and transformers with it) loads when a name of it is asked for, so a process that
needs one module of this package (a rank gathering groups, a producer) does not import the rest.
"""

from typing import TYPE_CHECKING, Any

from grpo.training.signals import TrainingStopped

if TYPE_CHECKING:
    from grpo.training.trainer import Trainer, train

__all__ = ["Trainer", "TrainingStopped", "train"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "train"):
        from grpo.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'grpo.training' has no attribute {name!r}")
