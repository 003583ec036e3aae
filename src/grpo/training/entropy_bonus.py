"""The entropy bonus's coefficient: fixed (``algorithm.entropy_coef``), or adapted after each
step towards ``algorithm.entropy_target`` (``grpo.algorithm.adapted_entropy_coef``, the rule of
Skywork-OR1) and saved in checkpoints, so a resumed run continues with the same coefficients."""

from __future__ import annotations

from typing import Any

from grpo import algorithm
from grpo.config import AlgorithmConfig


class EntropyBonus:
    """``coef`` for this step's loss; ``observe(metrics)`` after the step's update. The
    ``entropy/coef`` metric says the coefficient the step used (when the bonus is on)."""

    def __init__(self, algo: AlgorithmConfig) -> None:
        self.algo = algo
        self.coef = algo.entropy_coef

    @property
    def on(self) -> bool:
        return self.algo.entropy_coef > 0 or self.algo.entropy_target is not None

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's ``entropy/coef`` (none when the bonus is off); with a target, the next
        step's coefficient from the step's mean token entropy (``metrics["entropy"]``)."""
        if not self.on:
            return {}
        used = {"entropy/coef": self.coef}
        target = self.algo.entropy_target
        if target is not None:
            step = self.algo.entropy_coef_step
            self.coef = algorithm.adapted_entropy_coef(self.coef, metrics["entropy"], target, step)
        return used

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a fixed coefficient is the config's (a resume may change it); only an adapted one
        # is the run's own state
        if self.algo.entropy_target is not None:
            self.coef = float(state["coef"])
