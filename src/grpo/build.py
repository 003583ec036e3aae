"""One builder: a config -> the run's parts. ``grpo train``, ``grpo eval``, ``grpo curate`` and
the benchmarks assemble the stack here, the same way.

The parts come in the order a run needs them: what depends only on the config and the data
(``prompt_format``, ``reward_runner``) is built and checked before a run directory is touched;
the model parts (``load_model``, ``reference_of``, ``engine_of``) after. ``run_parts`` builds a
training run's parts in that order, in one call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from grpo.config import Config, ModelConfig, RewardsConfig, RolloutConfig
from grpo.data import (
    Asked,
    Curriculum,
    DataError,
    Rows,
    curriculum_of,
    heldout_rows,
    load_dataset_rows,
    question,
    seen_count,
    system_prompt_for,
    unseen_rows,
    verifier_of,
    whole_row,
)
from grpo.data.prompts import PromptFormat, prompt_format_for
from grpo.environments import Environment
from grpo.environments.classes import ClassEnvironment, load_class
from grpo.environments.openenv import OpenEnvEnvironment, is_openenv
from grpo.environments.verifiers import VerifiersEnvironment, is_verifiers
from grpo.models import (
    Reference,
    load_policy,
    load_tokenizer,
    mlp_shape,
    prepare_policy,
    prepare_tokenizer,
    resolve_model_path,
)
from grpo.rewards import RewardError, RewardRunner
from grpo.rewards.registry import RewardFn
from grpo.rollout import RolloutEngine
from grpo.rollout.engine import release
from grpo.rollout.turns import MultiTurnEngine, python_environment
from grpo.runtime import distributed
from grpo.runtime.host_memory import bound_kernel_caches
from grpo.runtime.precision import choose_precision, measure_rates, precision_line


def _hf_engine(**kwargs: Any) -> RolloutEngine:
    from grpo.rollout.hf import HFEngine

    return HFEngine(**kwargs)


def _vllm_engine(**kwargs: Any) -> RolloutEngine:
    from grpo.rollout.vllm import VLLMEngine  # imports vllm: only when asked for

    return VLLMEngine(**kwargs)


def _server_engine(**kwargs: Any) -> RolloutEngine:
    from grpo.rollout.server import ServerEngine

    return ServerEngine(kwargs["model"], kwargs["tokenizer"], kwargs["config"])


ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "hf": _hf_engine,
    "vllm": _vllm_engine,
    "server": _server_engine,
}


def build_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """The engine ``name`` (``rollout.engine``) over ``model``, ``tokenizer``, ``config``."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine '{name}'")
    return ENGINES[name](**kwargs)


def prepare_process(config: Config) -> None:
    """Process-wide settings a run needs before its first tensor operation: the kernel caches'
    bounds (``grpo.runtime.host_memory``) and the thread count."""
    bound_kernel_caches()
    if config.train.threads:
        torch.set_num_threads(config.train.threads)


def concrete_precision(
    config: Config, model: str | PretrainedConfig, device: torch.device
) -> Config:
    """``config`` with ``model.precision: auto`` decided on ``device`` for ``model`` (its folder
    or hub id, or a given model's config; ``grpo.runtime.precision``), said in one console line;
    as it is when the precision is set. Call it after ``prepare_process``: the thread count is
    part of the measurement."""
    if config.model.precision != "auto":
        return config
    rates = measure_rates(device, *mlp_shape(model))
    chosen = choose_precision(rates)
    # stderr: `grpo eval` keeps stdout for its JSON
    print(precision_line(chosen, rates, device), file=sys.stderr, flush=True)
    return config.model_copy(
        update={"model": config.model.model_copy(update={"precision": chosen})}
    )


@dataclass
class Given:
    """Parts a caller already holds (``grpo.train(rewards=..., dataset=..., model=...)``, see
    ``grpo.training.caller_parts``); None: built from the config."""

    rewards: dict[str, RewardFn] = field(default_factory=dict)  # spec name -> callable
    rows: Rows | None = None
    eval_rows: Rows | None = None
    model: nn.Module | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    # an environment class or factory (``grpo.train(environment=...)``)
    environment: Callable[[], Any] | None = None


def environment_of(config: Config, given: Callable[[], Any] | None = None) -> Environment | None:
    """What a run's completions play (``grpo.environments``): the Python tool of
    ``rollout.tools``, an environment class (the one given, else ``rollout.environment``'s),
    or None (one turn). A class that does not load or cannot be used is refused here."""
    rollout = config.rollout
    if rollout.tools:
        return python_environment(rollout)
    if given is None and rollout.environment and is_openenv(rollout.environment):
        return OpenEnvEnvironment(rollout.environment, rollout.environment_timeout_s)
    if given is None and rollout.environment and is_verifiers(rollout.environment):
        return VerifiersEnvironment(rollout.environment, rollout.environment_timeout_s)
    cls = given or (load_class(rollout.environment) if rollout.environment else None)
    if cls is None:
        return None
    return ClassEnvironment(cls, rollout.tool_call_format, rollout.tool_max_output_chars)


def training_rows(config: Config, given: Given) -> tuple[Rows, list[dict[str, Any]]]:
    """The rows a run trains on and its held-out rows (none without ``train.eval_every``): the
    given ones, else those the config names; with ``data.eval_unseen`` only held-out questions
    that none of the training rows (given or named) asks."""
    train = config.train
    rows = given.rows if given.rows is not None else load_dataset_rows(config.data, train.seed)
    if config.rollout.tools or config.rollout.environment:
        taken = next((c for c in TURN_COLUMNS if any(c in row for row in rows)), None)
        if taken is not None:
            raise DataError(
                f"{config.data.path or config.data.task or 'dataset'}: column '{taken}' has the "
                "name of an argument rewards get a multi-turn rollout's episodes in; rename it"
            )
    if not train.eval_every:
        return rows, []
    # unseen: against the rows this run trains on, which a caller may have given
    unseen, asked_by = config.data.eval_unseen, asked_by_rows(config)
    held_out = given.eval_rows
    if held_out is None:
        data = config.data.model_copy(update={"eval_unseen": False})
        held_out = heldout_rows(data, train.seed, None if unseen else train.eval_examples)
    if unseen:
        held_out = unseen_rows(held_out, rows, asked_by)
    held_out = held_out[: train.eval_examples]
    seen = seen_count(held_out, rows, asked_by)
    if seen:  # evaluation would partly measure recall of training questions
        print(
            f"held-out: {seen} of {len(held_out)} rows ask a question a training row also asks "
            "(data.eval_unseen: true leaves them out)",
            file=sys.stderr,
            flush=True,
        )
    return rows, held_out


def asked_by_rows(config: Config) -> Asked:
    """What tells two rows apart as questions (``data.eval_unseen``): the prompt and answer,
    or the whole row where an environment plays it (its ``reset`` gets every column)."""
    return whole_row if config.rollout.environment else question


# the columns reward functions get a multi-turn rollout's episodes in (grpo.rewards.inputs)
TURN_COLUMNS = ("turns", "environments", "environment_reward")


def prompt_format(config: Config, environment: Environment | None = None) -> PromptFormat:
    """How a row becomes the text the model continues (template, system prompt, and the tools
    of ``environment``, default the config's, where the chat template lists them)."""
    environment = environment or environment_of(config)
    tools = environment.tools if environment is not None else []
    return prompt_format_for(config.data, system_prompt_for(config.data), tools)


def episodeless_prompt_format(config: Config) -> PromptFormat:
    """The prompt format of a process that plays no episode (``grpo serve`` samples turns a
    trainer's loop plays): the config's environment is built for its tools, then closed (an
    OpenEnv server's or a verifiers environment's loop thread would otherwise outlive it)."""
    environment = environment_of(config)
    try:
        return prompt_format(config, environment)
    finally:
        release(environment)


def reward_runner(
    config: Config,
    rows: list[dict[str, Any]] | None = None,
    given: dict[str, RewardFn] | None = None,
    environment: Environment | None = None,
) -> RewardRunner:
    """The recipe's reward functions (``given``: callables the caller holds, by spec name),
    checked against the columns of ``rows`` when given and against the ``environment``
    completions play (default the config's): the ``environment`` reward needs one that scores
    its episodes."""
    environment = environment or environment_of(config)
    scored = environment is not None and environment.has_reward
    if any(spec.name == "environment" for spec in config.rewards.functions) and not scored:
        what = "there is no environment" if environment is None else f"{environment.name} has none"
        raise RewardError(
            f"reward 'environment' is an environment's own reward (get_reward): {what} "
            "(set rollout.environment to a class with one)"
        )
    # environment classes hand reward functions their live instances (TRL's contract)
    live = isinstance(environment, ClassEnvironment)
    rewards = RewardRunner(config.rewards, given, live_environments=live)
    if rows is not None:
        try:
            rewards.check_columns(rows)
        except RewardError:
            rewards.close()
            raise
    return rewards


def verifier_runner(config: Config) -> RewardRunner:
    """What evaluation judges correctness by (``grpo.data.verifier_of``), as a reward runner
    under the recipe's reward limits (workers, timeout)."""
    limits = config.rewards.model_dump(exclude={"functions"})
    return RewardRunner(
        RewardsConfig.model_validate({**limits, "functions": [verifier_of(config.data)]})
    )


def load_model(
    model: ModelConfig,
    path: str,
    fmt: PromptFormat,
    rows: list[dict[str, Any]],
    device: torch.device | None = None,
) -> tuple[PreTrainedTokenizerBase, nn.Module]:
    """Tokenizer and policy from a resolved model path (``resolve_model_path``). ``rows`` are
    checked against the prompt format with the tokenizer before the (slower) weights load."""
    tokenizer = load_tokenizer(path)
    fmt.check(tokenizer, rows)
    policy = load_policy(model, path)
    return tokenizer, policy if device is None else policy.to(device)


def given_model(
    model: ModelConfig,
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    fmt: PromptFormat,
    rows: list[dict[str, Any]],
    device: torch.device,
) -> tuple[PreTrainedTokenizerBase, nn.Module]:
    """``load_model`` for a model the caller loaded (its tokenizer: given, or from its folder)."""
    tokenizer = (
        load_tokenizer(policy.name_or_path) if tokenizer is None else prepare_tokenizer(tokenizer)
    )
    fmt.check(tokenizer, rows)
    return tokenizer, prepare_policy(policy, model).to(device)


def reference_of(config: Config, policy: nn.Module) -> Reference | None:
    """The frozen (or periodically refreshed) reference; None when beta = 0 (nothing loaded)."""
    algo = config.algorithm
    if algo.beta == 0:
        return None
    products = torch.bfloat16 if config.model.autocast else None
    # a mix without refreshes is refused by the config (USED_ONLY_WITH): alpha is 1 then
    return Reference(policy, products, algo.ref_mix_alpha)


def engine_of(
    config: Config,
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    engine: RolloutEngine | None = None,
    environment: Environment | None = None,
) -> RolloutEngine:
    """The rollout engine of ``rollout.engine`` (or the one given), inside the multi-turn loop
    when the recipe has an environment (``environment``, default the config's: the Python tool,
    an environment class): the wrapper is applied here, once."""
    rollout = config.rollout
    if engine is None:
        engine = build_engine(rollout.engine, model=policy, tokenizer=tokenizer, config=rollout)
    environment = environment or environment_of(config)
    if environment is not None and not isinstance(engine, MultiTurnEngine):
        fmt = prompt_format(config, environment)
        render = functools.partial(fmt.render, tokenizer)
        engine = MultiTurnEngine(engine, tokenizer, rollout, environment, render)
    return engine


@dataclass
class RunInputs:
    """What a training run is checked against before anything is written: the rows it trains
    on, its held-out rows (none without ``train.eval_every``), the prompt format, the reward
    runner, the verifier evaluation judges by (None without ``train.eval_every``), the
    model's resolved folder or hub id (None for a given model), the environment completions
    play (None: one turn) and the curriculum (None without ``data.curriculum``)."""

    rows: Rows
    eval_rows: list[dict[str, Any]]
    prompt_format: PromptFormat
    rewards: RewardRunner
    verifier: RewardRunner | None
    model_path: str | None
    environment: Environment | None = None
    curriculum: Curriculum | None = None

    def close(self) -> None:
        """Stop the reward (and verifier) workers."""
        self.rewards.close()
        if self.verifier is not None:
            self.verifier.close()


@dataclass
class RunParts:
    """A training run's parts: ``config`` with ``model.precision`` decided, the checked
    ``inputs``, the tokenizer, the policy (in train mode) and the reference (None when beta = 0).
    """

    config: Config
    inputs: RunInputs
    tokenizer: PreTrainedTokenizerBase
    policy: nn.Module
    reference: Reference | None


def run_inputs(config: Config, given: Given) -> RunInputs:
    """``RunInputs`` from the config and the given parts; a bad one is refused here."""
    if given.rows is not None and config.data.curriculum.enabled:
        raise DataError("data.curriculum draws the task's rows: not with a dataset given")
    rows, eval_rows = training_rows(config, given)
    curriculum = curriculum_of(config.data, config.train.seed)
    environment = environment_of(config, given.environment)
    fmt = prompt_format(config, environment)
    rewards = reward_runner(config, rows, given.rewards, environment)
    verifier = None
    try:
        verifier = verifier_runner(config) if config.train.eval_every else None
        model_path = None if given.model else resolve_model_path(config.model.name)
    except BaseException:
        rewards.close()
        if verifier is not None:  # a model name that does not resolve stops its workers too
            verifier.close()
        raise
    return RunInputs(rows, eval_rows, fmt, rewards, verifier, model_path, environment, curriculum)


def run_parts(
    config: Config,
    given: Given,
    device: torch.device,
    claim: Callable[[Config, RunInputs], None],
) -> RunParts:
    """A training run's parts, in the order it needs them: the inputs, checked (``run_inputs``);
    ``model.precision: auto`` decided once, by rank 0; then ``claim(config, inputs)``, where the
    caller locks its run directory and decides the resume before the (slower) model loads; then
    the tokenizer, the policy and the reference. The inputs' workers stop when a later part
    fails."""
    inputs = run_inputs(config, given)
    try:
        shape_of = inputs.model_path or given.model.config
        config = distributed.from_main(lambda: concrete_precision(config, shape_of, device))
        claim(config, inputs)
        fmt, rows = inputs.prompt_format, inputs.rows
        tokenizer, policy = (
            given_model(config.model, given.model, given.tokenizer, fmt, rows, device)
            if given.model is not None
            else load_model(config.model, inputs.model_path, fmt, rows, device)
        )
        policy.train()
        for name, checked in (("data", rows), ("held-out", inputs.eval_rows)):
            check_prompt_lengths(checked, fmt, tokenizer, policy, config.rollout, name)
        reference = reference_of(config, policy)
    except BaseException:
        inputs.close()
        raise
    return RunParts(config, inputs, tokenizer, policy, reference)


def check_prompt_lengths(
    rows: Sequence[dict[str, Any]],
    fmt: PromptFormat,
    tokenizer: PreTrainedTokenizerBase,
    policy: nn.Module,
    rollout: RolloutConfig,
    what: str,
) -> None:
    """Past the model's positions a rotary model samples and trains on positions it never
    learned, without an error: a prompt that alone fills them is refused in one line naming its
    row; one that leaves less room than ``rollout.max_new_tokens`` is said in one line."""
    limit = getattr(policy.config, "max_position_embeddings", None)
    if not limit:
        return
    lengths = [
        len(tokenizer(fmt.render(tokenizer, row), add_special_tokens=False).input_ids)
        for row in rows
    ]
    for index, length in enumerate(lengths, start=1):  # rows counted from 1, as fmt.check does
        if length >= limit:
            raise DataError(
                f"{what} row {index}: its prompt is {length} tokens, as many as the model's "
                f"{limit} positions or more; shorten it"
            )
    longest = max(lengths, default=0)
    if longest + rollout.max_new_tokens > limit:
        print(
            f"warning: {what} row {lengths.index(longest) + 1}'s prompt is {longest} tokens: with "
            f"rollout.max_new_tokens={rollout.max_new_tokens} a completion can pass the model's "
            f"{limit} positions (its tokens past them are sampled and trained on positions the "
            "model never learned)",
            file=sys.stderr,
        )


@dataclass
class Parts:
    """What eval and curate run with: a model in eval mode, its tokenizer, the prompt format,
    the reward runner (close it when done) and the environment completions play (None: one
    turn). Curate adds its engine (``engine_of``)."""

    tokenizer: PreTrainedTokenizerBase
    policy: nn.Module
    prompt_format: PromptFormat
    rewards: RewardRunner
    environment: Environment | None = None


def build_for_sampling(config: Config, rows: list[dict[str, Any]]) -> Parts:
    """``model.name`` with full weights (no adapters) in eval mode, and the rest of the stack
    as training builds it: for ``grpo eval`` and ``grpo curate``. The rewards are set up (and a
    bad one refused) before the model loads; they are closed when the model fails to."""
    prepare_process(config)
    environment = environment_of(config)
    fmt = prompt_format(config, environment)
    rewards = reward_runner(config, None, None, environment)
    try:
        path = resolve_model_path(config.model.name)
        model = ModelConfig(name=path, dtype=config.model.dtype)
        tokenizer, policy = load_model(model, path, fmt, rows)
    except BaseException:
        rewards.close()
        raise
    return Parts(tokenizer, policy.eval(), fmt, rewards, environment)
