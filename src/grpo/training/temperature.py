"""Rollout temperatures that keep groups mixed: a schedule over the steps, or an adaptive rule.

A group whose G completions all earn the same reward has zero advantage and teaches nothing
(``frac_zero_std``). Sampling hotter makes a group's completions differ more, so mixed groups get
likelier; too hot, and completions degenerate into text that rambles to the token limit.

- ``constant``: ``rollout.temperature`` at every step.
- ``linear`` / ``cosine``: from ``rollout.temperature`` at step 1 to ``temperature.end`` at the
  last step (cosine: half a cosine wave, flat at both ends).
- ``adaptive``: starts at ``rollout.temperature``; after each step, when the share of completions
  cut at the token limit (``truncated_frac``) passes ``temperature.degenerate_above``, the next
  rollout is ``temperature.step`` cooler; otherwise, when the mean ``frac_zero_std`` of the last
  ``temperature.window`` steps passes ``temperature.raise_above``, it is ``step`` hotter. Always
  within [``temperature.min``, ``temperature.max``]. Its state (the current temperature and the
  window) is saved in checkpoints, so a resumed run continues with the same temperatures.

The trainer scores every rollout with the temperature its tokens were sampled at.
"""

from __future__ import annotations

import math
from typing import Any

from grpo.config import Config


def scheduled(kind: str, start: float, end: float, step: int, total: int) -> float:
    """The temperature of ``step`` (1-based) of ``total`` on a constant/linear/cosine schedule."""
    if kind == "constant" or total <= 1:
        return start
    progress = min(max((step - 1) / (total - 1), 0.0), 1.0)
    if kind == "linear":
        return start + (end - start) * progress
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown temperature schedule '{kind}'")


def adapted(
    temperature: float,
    zero_std_window: list[float],
    truncated_frac: float,
    *,
    step: float,
    low: float,
    high: float,
    raise_above: float,
    degenerate_above: float,
) -> float:
    """The next rollout's temperature after a step (see the module docstring)."""
    if truncated_frac > degenerate_above:
        temperature -= step
    elif zero_std_window and sum(zero_std_window) / len(zero_std_window) > raise_above:
        temperature += step
    return min(max(temperature, low), high)


class TemperatureController:
    """The temperature of each step's rollout: ``for_step(step)`` before it, ``observe(metrics)``
    after it (adaptive only). ``state_dict`` / ``load_state_dict`` for checkpoints."""

    def __init__(self, config: Config) -> None:
        self.cfg = config.temperature
        self.start = config.rollout.temperature
        self.total = config.train.steps
        self.current = self.start
        self.window: list[float] = []

    def for_step(self, step: int) -> float:
        if self.cfg.schedule == "adaptive":
            return self.current
        return scheduled(self.cfg.schedule, self.start, self.cfg.end, step, self.total)

    def observe(self, metrics: dict[str, float]) -> None:
        if self.cfg.schedule != "adaptive":
            return
        self.window = [*self.window, metrics["frac_zero_std"]][-self.cfg.window :]
        self.current = adapted(
            self.current,
            self.window,
            metrics["truncated_frac"],
            step=self.cfg.step,
            low=self.cfg.min,
            high=self.cfg.max,
            raise_above=self.cfg.raise_above,
            degenerate_above=self.cfg.degenerate_above,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current, "window": list(self.window)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current = float(state["current"])
        self.window = [float(x) for x in state["window"]]
