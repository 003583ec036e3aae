"""Resolution: what a config derives from its own choices, computed once when it is validated.

- A built-in task brings its default rewards (humaneval: ``code``) unless the recipe names some.
- ``algorithm.estimator`` brings its own defaults for fields left unset, before the preset's:
  rloo does not scale by a std (``scale_rewards: none``, as TRL's RLOOTrainer and verl's rloo),
  reinforce_pp and ppo fold the k1 KL into their rewards (``kl_estimator: k1``, as the
  REINFORCE++ paper and verl's PPO).
- ``algorithm.preset`` fills every field of its member of the family that was not set
  explicitly (``grpo.config.presets``).
- Rules between sections that hold only after both steps (a reference refresh needs ``beta``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from grpo.config.presets import preset_updates
from grpo.data.tasks import TASKS

if TYPE_CHECKING:
    from grpo.config.schema import AlgorithmConfig, Config


# the HF engine's own sampling keys (a `grpo serve` HF engine checks them against the run's)
HF_ENGINE_ONLY = ("pack_float32", "compile")


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
    _estimator_defaults(config)
    for name, updates in preset_updates(config).items():
        section = getattr(config, name)
        _replace(
            config,
            name,
            type(section).model_validate({**section.model_dump(exclude_unset=True), **updates}),
        )
    _refuse_contradictions(config)


def _refuse_contradictions(config: Config) -> None:
    """Refuse (``ValueError``) a resolved config with a knob that would do nothing or two that
    contradict each other."""
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
    for name, (applies, when) in USED_ONLY_WITH.items():
        # off its default, not merely written down: a saved run's config spells out every
        # default, and a resume of it must not be refused for that
        if getattr(algo, name) != type(algo).model_fields[name].default and not applies(algo):
            raise ValueError(f"algorithm.{name} is set but not used: it applies only {when}")
    for name in HF_ENGINE_ONLY:
        if getattr(config.rollout, name) and config.rollout.engine == "vllm":
            raise ValueError(
                f"rollout.{name} is set but not used: it applies only with rollout.engine hf "
                "(or server, whose HF engine must say the same)"
            )
    for name in ("tools", "environment"):
        if config.rollout.engine == "server" and getattr(config.rollout, name):
            raise ValueError(
                f"rollout.{name} runs its turn loop around a local engine: not with "
                "rollout.engine server (use hf or vllm)"
            )
    if config.rollout.tools and config.rollout.environment:
        raise ValueError(
            "rollout.tools and rollout.environment: one environment a run (the Python tool is "
            "one); set one of them"
        )
    if config.rollout.max_staleness and unbounded:
        raise ValueError(
            f"rollout.max_staleness={config.rollout.max_staleness} trains on rollouts of older "
            "weights: set algorithm.tis_cap (e.g. 2.0) so they are importance-weighted "
            "(docs/ahead.md)"
        )
    _refuse_curriculum(config)
    if algo.ref_mix_alpha < 1 and config.model.lora.enabled:
        raise ValueError(
            "algorithm.ref_mix_alpha < 1 needs full weights "
            "(mixing LoRA factors does not mix the weights)"
        )


def _refuse_curriculum(config: Config) -> None:
    """A curriculum needs a reasoning-gym task, a reward to count passes by, and rows drawn in
    the trainer's step order (``grpo.data.curriculum``)."""
    curriculum = config.data.curriculum
    if not curriculum.enabled:
        fields = type(curriculum).model_fields
        # off its default, as USED_ONLY_WITH: a saved run's config spells out every default
        changed = [k for k in fields if getattr(curriculum, k) != fields[k].default]
        if changed:
            raise ValueError(
                f"data.curriculum.{changed[0]} is set but not used: set data.curriculum.enabled"
            )
        return
    if config.data.path is not None or config.data.task != "reasoning_gym":
        raise ValueError("data.curriculum needs data.task: reasoning_gym (and no data.path)")
    names = [spec.name.rpartition(":")[2] for spec in config.rewards.functions]
    if curriculum.reward not in names:
        raise ValueError(
            f"data.curriculum.reward '{curriculum.reward}' is not one of the run's rewards "
            f"({', '.join(names)})"
        )
    # the level of a step's prompts is the one after the step before: a producer making steps
    # ahead would have to wait for it, which is what it must not do
    if config.rollout.max_staleness:
        raise ValueError(
            "data.curriculum needs rollout.max_staleness: 0 (steps made ahead would be drawn "
            "before the level they depend on is known)"
        )
    if config.sampling.greso:
        raise ValueError(
            "data.curriculum draws new rows at every level: sampling.greso, which remembers "
            "rows by their index, does not apply"
        )


def _is_ppo(algo: AlgorithmConfig) -> bool:
    return algo.estimator == "ppo"


# algorithm fields that only one setting reads -> (whether it is on, how a line says so): a
# recipe that sets one without it would believe it changed the run
USED_ONLY_WITH: dict[str, tuple[Callable[[AlgorithmConfig], bool], str]] = {
    "sapo_tau_pos": (lambda a: a.loss_type == "sapo", "with loss_type sapo"),
    "sapo_tau_neg": (lambda a: a.loss_type == "sapo", "with loss_type sapo"),
    "cispo_clip_low": (lambda a: a.loss_type == "cispo", "with loss_type cispo"),
    "cispo_clip_high": (lambda a: a.loss_type == "cispo", "with loss_type cispo"),
    "entropy_coef_step": (lambda a: a.entropy_target is not None, "with entropy_target"),
    "gamma": (_is_ppo, "with estimator ppo"),
    "lam": (_is_ppo, "with estimator ppo"),
    "value_clip": (_is_ppo, "with estimator ppo"),
    "critic_lr": (_is_ppo, "with estimator ppo"),
    "critic_model": (_is_ppo, "with estimator ppo"),
    "ref_mix_alpha": (lambda a: bool(a.ref_update_every), "with ref_update_every"),
}


# estimator -> the values it gives fields a recipe leaves unset
ESTIMATOR_DEFAULTS: dict[str, dict[str, str]] = {
    "grpo": {},
    "rloo": {"scale_rewards": "none"},
    "reinforce_pp": {"kl_estimator": "k1"},
    "ppo": {"kl_estimator": "k1"},
}


def _estimator_defaults(config: Config) -> None:
    algo = config.algorithm
    if algo.estimator in ("reinforce_pp", "ppo") and algo.reward_aggregation == "gdpo":
        raise ValueError(
            "algorithm.reward_aggregation=gdpo normalises each reward within its group; "
            f"estimator {algo.estimator} has no groups: use estimator grpo or rloo"
        )
    defaults = ESTIMATOR_DEFAULTS[algo.estimator]
    unset = {k: v for k, v in defaults.items() if k not in algo.model_fields_set}
    if unset:
        tree = {**algo.model_dump(exclude_unset=True), **unset}
        _replace(config, "algorithm", type(algo).model_validate(tree))


def _replace(config: Config, name: str, section: object) -> None:
    # a plain attribute write: validate_assignment would run the config's validators again
    object.__setattr__(config, name, section)
