"""The training state, with one owner: what a run changes as it trains and a resume restores.

``TrainingState`` holds the policy, its optimizer and schedule, the reference, PPO's critic,
the entropy bonus, the reward-hacking watch, the producer (whose state is the data position:
prompts consumed, GRESO's history, the temperature) and the step. ``state_dict`` is the contents
of a checkpoint's ``trainer_state.pt`` but the world size (``grpo.training.checkpoint`` writes
the file and the policy's weights around it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo.models import Reference, is_lora
from grpo.runtime import distributed
from grpo.training.critic import Critic
from grpo.training.entropy_bonus import EntropyBonus
from grpo.training.hack_watch import HackWatch
from grpo.training.optimizer import load_master_state, master_state
from grpo.training.producer import Producer


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


@dataclass
class TrainingState:
    """Everything a resume needs to continue bit for bit; ``step``: the training steps done."""

    policy: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: Reference | None  # beta > 0
    critic: Critic | None  # estimator ppo
    entropy_bonus: EntropyBonus
    hack_watch: HackWatch
    producer: Producer  # the data position
    step: int = 0

    def state_dict(self, optimizer: dict[str, Any]) -> dict[str, Any]:
        """``trainer_state.pt`` but the world size; ``optimizer``: the optimizer's whole state,
        which every rank gathers (``distributed.optimizer_state``) before rank 0 calls this."""
        return {
            "step": self.step,
            **self.producer.state_dict(),  # consumed, greso, temperature
            "optimizer": optimizer,
            # float32 masters of bf16 weights (grpo.training.optimizer); the HF folder holds them
            # rounded, and a resume from those alone would lose what rounding dropped
            "master": master_state(self.policy, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng(),
            "hack_watch": self.hack_watch.state_dict(),
            "entropy_bonus": self.entropy_bonus.state_dict(),
            "reference": None if self.reference is None else self.reference.state_dict(),
            "critic": None if self.critic is None else self.critic.state_dict(),
            # LoRA: only the adapters train
            "trainable": {k: v for k, v in self.policy.state_dict().items() if "lora_" in k}
            if is_lora(self.policy)
            else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``trainer_state.pt`` (its ``rng``: this rank's); the weights are loaded
        first (``grpo.training.checkpoint``). Raises ValueError for a checkpoint without the
        critic this run trains."""
        load_master_state(self.policy, self.optimizer, state.get("master"))
        distributed.load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        self.producer.load_state_dict(state)
        if state.get("hack_watch"):  # a checkpoint from before the watch starts it afresh
            self.hack_watch.load_state_dict(state["hack_watch"])
        if state.get("entropy_bonus"):
            self.entropy_bonus.load_state_dict(state["entropy_bonus"])
        if self.reference is not None and state.get("reference"):
            self.reference.load_state_dict(state["reference"])
        if self.critic is not None:
            if not state.get("critic"):
                raise ValueError("the checkpoint holds no critic (saved by another estimator)")
            self.critic.load_state_dict(state["critic"])
        self.step = state["step"]
