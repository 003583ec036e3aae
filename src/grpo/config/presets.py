"""Algorithm presets: `algorithm.preset` picks a member of the GRPO family.

Each preset is the published recipe of one paper, written as config values per section. A preset
fills in only the fields a recipe or override did not set (pydantic's ``model_fields_set``), so
``algorithm.preset=dapo algorithm.clip_high=0.3`` is DAPO with a wider upper clip. Every preset
names the same fields, so switching presets never leaves one paper's value behind.

- grpo (DeepSeekMath, Shao et al., 2024): group-std advantages, per-sequence token mean,
  k3 KL with beta 0.04, symmetric clip 0.2.
- dapo (Yu et al., 2025): clip_low 0.2 / clip_high 0.28 ("clip-higher"), token mean over the
  whole step, dynamic sampling, no KL, and the ``overlong`` soft punishment added to the default
  rewards (max_length = rollout.max_new_tokens, buffer = a fifth of it: DAPO's 4096 of 20480).
- dr_grpo (Liu et al., 2025): centred rewards without std scaling, token sum over a constant
  budget (sequences x max_new_tokens), no KL (their Oat-Zero runs use beta 0).
- gspo (Zheng et al., 2025): sequence-level ratio ``exp(mean_t(logp - old_logp))`` with clip
  ranges 3e-4 / 4e-4, per-sequence loss, no KL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo.config import Config


def _with_overlong(config: Config) -> list[dict[str, Any]]:
    """The configured (default) rewards plus DAPO's soft overlong punishment."""
    budget = config.rollout.max_new_tokens
    overlong = {"name": "overlong", "args": {"max_length": budget, "buffer": max(1, budget // 5)}}
    return [*(spec.model_dump() for spec in config.rewards.functions), overlong]


# preset -> section -> field -> value (or a function of the config); every preset names the
# same algorithm and sampling fields
PRESETS: dict[str, dict[str, dict[str, Any | Callable[[Config], Any]]]] = {
    "grpo": {
        "algorithm": {
            "scale_rewards": "group",
            "loss_type": "grpo",
            "ratio_level": "token",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "beta": 0.04,
            "kl_estimator": "k3",
        },
        "sampling": {"dynamic": False},
    },
    "dapo": {
        "algorithm": {
            "scale_rewards": "group",
            "loss_type": "dapo",
            "ratio_level": "token",
            "clip_low": 0.2,
            "clip_high": 0.28,
            "beta": 0.0,
            "kl_estimator": "k3",
        },
        "sampling": {"dynamic": True},
        "rewards": {"functions": _with_overlong},
    },
    "dr_grpo": {
        "algorithm": {
            "scale_rewards": "none",
            "loss_type": "dr_grpo",
            "ratio_level": "token",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "beta": 0.0,
            "kl_estimator": "k3",
        },
        "sampling": {"dynamic": False},
    },
    "gspo": {
        "algorithm": {
            "scale_rewards": "group",
            "loss_type": "grpo",
            "ratio_level": "sequence",
            "clip_low": 3e-4,
            "clip_high": 4e-4,
            "beta": 0.0,
            "kl_estimator": "k3",
        },
        "sampling": {"dynamic": False},
    },
}


def preset_updates(config: Config) -> dict[str, dict[str, Any]]:
    """Section -> {field: preset value} for the preset's fields the config did not set."""
    out: dict[str, dict[str, Any]] = {}
    for section, values in PRESETS[config.algorithm.preset].items():
        explicit = getattr(config, section).model_fields_set
        unset = {
            key: value(config) if callable(value) else value
            for key, value in values.items()
            if key not in explicit
        }
        if unset:
            out[section] = unset
    return out
