"""Resolution: what a config derives from its own choices, computed once when it is validated.

- A built-in task brings its default rewards (humaneval: ``code``) unless the recipe names some.
- ``algorithm.preset`` fills every field of its member of the family that was not set
  explicitly (``grpo.config.presets``).
- Rules between sections that hold only after both steps (a reference refresh needs ``beta``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.config.presets import preset_updates
from grpo.data.tasks import TASKS

if TYPE_CHECKING:
    from grpo.config.schema import Config


def resolve(config: Config) -> None:
    """Fill ``config``'s derived values in place (sections are replaced, never mutated)."""
    task = TASKS.get(config.data.task) if config.data.path is None else None
    if task is not None and "functions" not in config.rewards.model_fields_set:
        resolved = type(config.rewards).model_validate(
            {**config.rewards.model_dump(exclude_unset=True), "functions": task.default_rewards}
        )
        # still a default, not the user's choice: a preset may extend it (dapo adds overlong)
        resolved.__pydantic_fields_set__.discard("functions")
        _replace(config, "rewards", resolved)
    for name, updates in preset_updates(config).items():
        section = getattr(config, name)
        _replace(
            config,
            name,
            type(section).model_validate({**section.model_dump(exclude_unset=True), **updates}),
        )
    algo = config.algorithm
    if algo.ref_update_every and algo.beta == 0:
        raise ValueError("algorithm.ref_update_every needs beta > 0 (beta 0 loads no reference)")
    if algo.dual_clip is not None and algo.loss_type in ("cispo", "sapo"):
        raise ValueError(
            f"algorithm.dual_clip bounds the clipped surrogate; loss_type={algo.loss_type} has none"
        )
    if algo.tis_low is not None and algo.tis_mode != "mask":
        raise ValueError("algorithm.tis_low needs tis_mode=mask (truncation has no lower bound)")
    unbounded = algo.tis_cap is None and algo.tis_low is None
    if unbounded and (algo.tis_mode, algo.tis_level) != ("truncate", "token"):
        # without a bound the correction is off: the level or mode asked for would do nothing
        raise ValueError(
            f"algorithm.tis_mode={algo.tis_mode} tis_level={algo.tis_level} needs a bound: "
            "set tis_cap (or tis_low with tis_mode=mask)"
        )
    if algo.ref_mix_alpha < 1 and config.model.lora.enabled:
        raise ValueError(
            "algorithm.ref_mix_alpha < 1 needs full weights "
            "(mixing LoRA factors does not mix the weights)"
        )


def _replace(config: Config, name: str, section: object) -> None:
    # a plain attribute write: validate_assignment would run the config's validators again
    object.__setattr__(config, name, section)
