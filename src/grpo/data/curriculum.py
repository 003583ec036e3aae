"""The curriculum (``data.curriculum``): a reasoning-gym task's difficulty level, moved by the
rolling pass rate of the current level, and each level's rows by stream position.

A level is reasoning-gym's curriculum for the generator (every generator of a mix at the same
level, each capped at its own last level; ``grpo.data.reasoning_gym.level_config``) over
``task_args``'s config. After each step, the share of its completions that pass (the score of
``curriculum.reward`` at least ``pass_score``) joins a window of the last ``window`` steps at
the current level; with the window full, its pass rate above ``upper`` moves one level up, below
``lower`` one level down, and a move empties the window (``moved``). Groups then stay mixed: a
level the model always solves, or never, teaches nothing.

The row at stream position p on level L is reasoning-gym's item p of the level's config seeded
with the train split's first seed: a function of (L, p), and L of the steps before, so a resumed
run draws exactly the rows the uninterrupted one drew. The level and the window are the state a
checkpoint keeps (``state_dict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo.data.reasoning_gym import (
    SEED_SPAN,
    Generator,
    GymError,
    as_row,
    checked_config,
    curricula,
    dataset,
    generators,
    level_config,
    split_seed,
    top_level,
)

if TYPE_CHECKING:
    from grpo.config import CurriculumConfig


def moved(level: int, rate: float, *, lower: float, upper: float, top: int) -> int:
    """The level after a full window with pass rate ``rate``: one up above ``upper``, one down
    below ``lower``, within [0, ``top``]."""
    if rate > upper:
        return min(level + 1, top)
    if rate < lower:
        return max(level - 1, 0)
    return level


def pass_rate(window: list[tuple[int, int]]) -> float:
    """Passes over completions of the window's steps ((passes, completions) each)."""
    total = sum(n for _, n in window)
    return sum(p for p, _ in window) / total if total else 0.0


@dataclass
class Levels:
    """The task's generators at each level: ``top`` is the last; ``configs(level)`` the
    generators with that level's configs; ``rows`` / ``row`` draw from them."""

    base: list[Generator]
    attributes: list[str] | None
    top: int
    seed: int  # train.seed
    # level -> its generators and dataset, made when the stream first reaches the level
    _stream: dict[int, tuple[list[Generator], Any]] = field(default_factory=dict, repr=False)

    def configs(self, level: int) -> list[Generator]:
        return [
            Generator(g.name, g.weight, level_config(g.name, g.config, level, self.attributes))
            for g in self.base
        ]

    def rows(self, split: str, level: int, size: int) -> list[dict[str, Any]]:
        """``size`` rows of ``split`` at ``level`` (held-out rows: the top level's)."""
        gens = self.configs(level)
        data = dataset(gens, split_seed(split, self.seed), size)
        return [as_row(data[i], gens) for i in range(size)]

    def row(self, level: int, position: int) -> dict[str, Any]:
        """The training row at stream ``position`` on ``level``."""
        if position >= SEED_SPAN:
            raise GymError(f"data.curriculum: a run draws at most {SEED_SPAN} rows")
        if level not in self._stream:
            gens = self.configs(level)
            self._stream[level] = gens, dataset(gens, split_seed("train", self.seed), SEED_SPAN)
        gens, data = self._stream[level]
        return as_row(data[position], gens)


def levels_of(task_args: dict[str, Any], config: CurriculumConfig, seed: int) -> Levels:
    """The levels of a reasoning_gym task under ``config``, every level's config checked; a
    generator without a curriculum, an attribute none has, a start above the top or a
    curriculum whose level can never move is a GymError (one line)."""
    args = {k: v for k, v in task_args.items() if k != "size"}
    base = generators(**args)
    known = curricula()
    for gen in base:
        if gen.name not in known:
            raise GymError(f"data.curriculum: reasoning-gym has no curriculum for '{gen.name}'")
    if config.attributes is not None:
        have = {a for gen in base for a in known[gen.name]().attributes}
        for attr in config.attributes:
            if attr not in have:
                raise GymError(
                    f"data.curriculum.attributes: no generator has '{attr}' "
                    f"(they have: {', '.join(sorted(have))})"
                )
    top = max(top_level(gen.name, config.attributes) for gen in base)
    if config.max_level is not None:
        if config.max_level > top:
            raise GymError(f"data.curriculum.max_level {config.max_level}: the last level is {top}")
        top = config.max_level
    if config.start_level > top:
        raise GymError(f"data.curriculum.start_level {config.start_level}: the last level is {top}")
    up = config.start_level < top and config.upper < 1
    down = config.start_level > 0 and config.lower > 0
    if not (up or down):
        raise GymError(
            f"data.curriculum: no level can move (levels 0-{top}, start {config.start_level}, "
            f"lower {config.lower:g}, upper {config.upper:g})"
        )
    levels = Levels(base, config.attributes, top, seed)
    for level in range(top + 1):
        for gen in levels.configs(level):
            try:
                checked_config(gen.name, gen.config)
            except GymError as err:
                raise GymError(f"data.curriculum level {level}: {err}") from None
    return levels


class Curriculum:
    """The current level and its window; ``row(position)`` draws at the current level,
    ``observe(scores)`` after each step (see the module docstring)."""

    def __init__(self, config: CurriculumConfig, levels: Levels) -> None:
        self.config, self.levels = config, levels
        self.level = config.start_level
        self.window: list[tuple[int, int]] = []  # (passes, completions) per step at this level

    def row(self, position: int) -> dict[str, Any]:
        return self.levels.row(self.level, position)

    def observe(self, scores: list[float]) -> dict[str, float]:
        """After a step: its completions' scores of ``curriculum.reward`` (NaN: none, no pass);
        the metrics ``curriculum/level`` (of this step's prompts) and ``curriculum/pass_rate``
        (the window's, which the rule compared)."""
        cfg, level = self.config, self.level
        passes = sum(1 for s in scores if not math.isnan(s) and s >= cfg.pass_score)
        self.window = [*self.window, (passes, len(scores))][-cfg.window :]
        rate = pass_rate(self.window)
        if len(self.window) == cfg.window:
            self.level = moved(level, rate, lower=cfg.lower, upper=cfg.upper, top=self.levels.top)
        if self.level != level:
            self.window = []
        return {"curriculum/level": float(level), "curriculum/pass_rate": rate}

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "window": [list(w) for w in self.window]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = int(state["level"])
        self.window = [(int(p), int(n)) for p, n in state["window"]]
