"""Training: the loop (``trainer``) and the modules it wires."""

from grpo.training.signals import TrainingStopped
from grpo.training.trainer import Trainer, train

__all__ = ["Trainer", "TrainingStopped", "train"]
