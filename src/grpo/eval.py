"""Held-out evaluation: greedy accuracy, pass@k and maj@k on a task's test split.

- ``accuracy``: one greedy completion per problem, correct when its extracted answer matches the
  gold answer. Extraction and matching are those of the recipe's ``accuracy`` reward (its
  ``extract`` / ``last_number`` arguments), so eval and training judge answers the same way.
- ``pass@k``: from n sampled completions with c correct, the unbiased estimator of Chen et al.
  (2021), ``1 - C(n-c, k) / C(n, k)``, averaged over problems; reported for k = 1, 2, 4, ... n.
- ``maj@k``: the most frequent extracted answer among the k samples (ties: the one seen first;
  completions without an answer do not vote) is judged against the gold answer.
- ``answer_rate``: share of greedy completions that contain an <answer> tag at all.
- ``completion_len``: mean length of the greedy completions, in tokens.
- ``reward/mean``, ``reward/<fn>/mean``, ``reward/pass_rate``: the recipe's own reward functions
  on the greedy completions (the total, each function, and the share whose total reaches
  ``train.eval_reward_threshold``). Data without gold answers gets these (and ``answer_rate``,
  ``completion_len``) only.

The held-out rows are ``data.eval_path`` when set, else the task's (or ``datasets`` folder's) test
split.

``grpo eval`` prints the result as JSON; the trainer calls ``evaluate`` every
``train.eval_every`` steps and logs each value as ``eval/<name>``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo.config import Config, RolloutConfig
from grpo.data import DataError, load_dataset_rows
from grpo.data.prompts import PromptFormat, scored_texts
from grpo.rewards import RewardOutput, RewardRunner
from grpo.rewards.accuracy import (
    DEFAULT_EXTRACT,
    AccuracyReward,
    answers_match,
    equivalent_in_process,
    extract_answer,
)
from grpo.rewards.inputs import per_function_metrics
from grpo.rollout.hf import HFEngine, eos_ids
from grpo.rollout.turns import MultiTurnEngine, greedy_answers, tool_metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k completions drawn without replacement from n (c of
    them correct) is correct: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct completion
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most common non-None answer (whitespace-stripped); ties go to the one seen first."""
    votes = Counter(a.strip() for a in answers if a is not None)
    if not votes:
        return None
    best = max(votes.values())
    return next(a.strip() for a in answers if a is not None and votes[a.strip()] == best)


def is_correct(
    completion: str, gold: Any, extract: tuple[str, ...] = DEFAULT_EXTRACT, symbolic: bool = True
) -> bool:
    """The extracted answer matches the gold one; ``symbolic`` adds math-verify's equivalence
    (without it "23 + 30" is not 53)."""
    predicted = extract_answer(completion, extract)
    return predicted is not None and _match(predicted, gold, symbolic)


def _match(predicted: str, gold: Any, symbolic: bool) -> bool:
    return answers_match(predicted, str(gold), equivalent_in_process if symbolic else None)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


@dataclass(frozen=True)
class EvalSettings:
    """How to generate and judge: ``samples`` > 1 adds sampled completions for pass@k and
    maj@k; ``extract`` lists the answer extraction strategies, tried in order."""

    samples: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    batch_size: int = 32
    extract: tuple[str, ...] = DEFAULT_EXTRACT
    reward_threshold: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings, as in training (``rollout.stop``)
    symbolic: bool = True  # math-verify equivalence, as the recipe's accuracy reward's math_verify


@torch.no_grad()
def _generate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    settings: EvalSettings,
    num: int,
    greedy: bool,
) -> list[list[str]]:
    """[len(prompts)][num] completion texts, generated in batches of prompts."""
    eos = eos_ids(tokenizer, model)
    sampling = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": settings.temperature, "top_k": None, "top_p": 1.0}
    )
    if settings.stop:  # a row ends with the token that completes a stop string, as in training
        sampling |= {"stop_strings": list(settings.stop), "tokenizer": tokenizer}
    out: list[list[str]] = []
    per_batch = max(1, settings.batch_size // num)
    for start in range(0, len(prompts), per_batch):
        chunk = prompts[start : start + per_batch]
        enc = tokenizer(
            chunk, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        ids = model.generate(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            max_new_tokens=settings.max_new_tokens,
            num_return_sequences=num,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            **sampling,
        )
        texts = tokenizer.batch_decode(ids[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        out.extend(texts[i * num : (i + 1) * num] for i in range(len(chunk)))
    return out


def score_samples(
    samples: list[list[str]],
    golds: list[Any],
    extract: tuple[str, ...] = DEFAULT_EXTRACT,
    symbolic: bool = True,
) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... n and maj@n from n samples per problem."""
    n = len(samples[0])
    out: dict[str, float] = {}
    correct = [
        sum(is_correct(s, g, extract, symbolic) for s in group)
        for group, g in zip(samples, golds, strict=True)
    ]
    for k in k_values(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(golds)
    votes = [majority_answer([extract_answer(s, extract) for s in group]) for group in samples]
    out[f"maj@{n}"] = sum(
        v is not None and _match(v, g, symbolic) for v, g in zip(votes, golds, strict=True)
    ) / len(golds)
    return out


def reward_metrics(output: RewardOutput, threshold: float) -> dict[str, float]:
    """The recipe's rewards on held-out completions: total mean, share of totals >= threshold,
    and each function's mean over the completions it applied to."""
    total = output.total
    out = {
        "reward/mean": float(total.mean()),
        "reward/pass_rate": float((total >= threshold).float().mean()),
    }
    functions = per_function_metrics(output.per_function, output.names)
    out.update({f"reward/{name}/mean": functions[f"reward/{name}/mean"] for name in output.names})
    return out


def judge_with_rewards(
    rewards: RewardRunner,
    rows: list[dict[str, Any]],
    texts: list[str],
    tokenizer: PreTrainedTokenizerBase,
    raw: list[str],
) -> RewardOutput:
    """Score one completion per row as training does: dataset columns as keyword lists."""
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
    ids = [tokenizer(c, add_special_tokens=False).input_ids for c in raw]
    return rewards(texts, [row["prompt"] for row in rows], columns, ids)


def evaluate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    prompt_format: PromptFormat,
    settings: EvalSettings = EvalSettings(),
    rewards: RewardRunner | None = None,
    complete: Callable[[list[str]], list[str]] | None = None,
) -> dict[str, float]:
    """Greedy accuracy (and pass@k / maj@k when settings.samples > 1) over ``rows`` when every
    row has a gold ``answer``, and the ``rewards`` (the recipe's functions) when given.

    ``complete`` maps rendered prompts to greedy answers in place of plain generation (the
    trainer's multi-turn tool loop); pass@k and maj@k need plain generation.
    """
    prompts = [prompt_format.render(tokenizer, r) for r in rows]
    golds = [r.get("answer") for r in rows]
    has_gold = all(g is not None for g in golds)
    if not has_gold and rewards is None:
        raise DataError("evaluation rows need an 'answer' column (or reward functions to judge)")
    was_training = model.training
    model.eval()
    try:
        raw = (
            complete(prompts)
            if complete is not None
            else [group[0] for group in _generate(model, tokenizer, prompts, settings, 1, True)]
        )
        greedy = scored_texts(prompts, raw)  # judged with the tag the prompt opened
        sampled = (
            [
                scored_texts([p] * len(group), group)
                for p, group in zip(
                    prompts,
                    _generate(model, tokenizer, prompts, settings, settings.samples, False),
                    strict=True,
                )
            ]
            if settings.samples > 1
            else None
        )
    finally:
        model.train(was_training)
    out = {
        "answer_rate": sum(extract_answer(c, ("answer",)) is not None for c in greedy) / len(rows),
        "completion_len": sum(len(tokenizer(c, add_special_tokens=False).input_ids) for c in raw)
        / len(rows),
        "examples": float(len(rows)),
    }
    if has_gold:
        judge = (settings.extract, settings.symbolic)
        correct = [is_correct(c, g, *judge) for c, g in zip(greedy, golds, strict=True)]
        out["accuracy"] = sum(correct) / len(rows)
        if sampled is not None:
            out.update(score_samples(sampled, golds, *judge))
    if rewards is not None:
        judged = judge_with_rewards(rewards, rows, greedy, tokenizer, raw)
        out.update(reward_metrics(judged, settings.reward_threshold))
    return dict(sorted(out.items()))


def evaluate_with_tools(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    prompt_format: PromptFormat,
    rollout: RolloutConfig,
    settings: EvalSettings = EvalSettings(),
    rewards: RewardRunner | None = None,
) -> dict[str, float]:
    """``evaluate`` with each greedy answer taken through the multi-turn tool loop of
    ``rollout`` (as training rollouts are), plus the ``tools/*`` metrics of those answers."""
    engine = MultiTurnEngine(HFEngine(model, tokenizer, rollout), tokenizer, rollout, greedy=True)
    turns: list[list[dict[str, Any]]] = []

    def complete(prompts: list[str]) -> list[str]:
        answers, seen = greedy_answers(engine, prompts, settings.batch_size)
        turns.extend(seen)
        return answers

    result = evaluate(model, tokenizer, rows, prompt_format, settings, rewards, complete)
    return dict(sorted({**result, **tool_metrics(turns)}.items()))


def heldout_rows(config: Config, examples: int | None) -> list[dict[str, Any]]:
    """The first ``examples`` held-out rows: ``data.eval_path`` when set, else a task's test
    split or the 'test' split of a `datasets` folder. A single training file has none."""
    data = config.data.model_copy(update={"num_examples": None})
    if data.eval_path is not None:
        data = data.model_copy(update={"path": data.eval_path})
    elif data.path is not None and not Path(data.path).is_dir():
        raise DataError(
            f"data.path {data.path}: a single file has no held-out split for evaluation "
            "(set data.eval_path, or use a built-in task or a datasets folder with a 'test' split)"
        )
    rows = load_dataset_rows(data, config.train.seed, "test")
    return rows[:examples] if examples else rows


def extract_of(config: Config) -> tuple[str, ...]:
    """The answer extraction of the recipe's ``accuracy`` reward (the default without one)."""
    for spec in config.rewards.functions:
        if spec.name == "accuracy":
            return AccuracyReward(**{**spec.args, "math_verify": False}).strategies
    return DEFAULT_EXTRACT


def symbolic_of(config: Config) -> bool:
    """Whether the recipe's ``accuracy`` reward accepts math-verify's equivalence (its default)."""
    for spec in config.rewards.functions:
        if spec.name == "accuracy":
            return bool(spec.args.get("math_verify", True))
    return True


def settings_for(config: Config, samples: int) -> EvalSettings:
    return EvalSettings(
        samples=samples,
        max_new_tokens=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        extract=extract_of(config),
        reward_threshold=config.train.eval_reward_threshold,
        stop=tuple(config.rollout.stop),
        symbolic=symbolic_of(config),
    )


def eval_data_of(config: Config) -> dict[str, Any]:
    """What ``heldout_rows`` reads, for the JSON output: a file or folder, or a task."""
    data = config.data
    if data.eval_path is not None:
        return {"path": str(Path(data.eval_path).resolve())}
    if data.path is not None:
        return {"path": str(Path(data.path).resolve()), "split": "test"}
    return {"task": data.task, "task_args": data.task_args, "split": "test"}


def evaluate_config(config: Config, samples: int, examples: int | None) -> dict[str, float]:
    """Load ``config.model.name`` (full weights, no adapters) and evaluate it on the held-out
    rows of ``config.data`` with the rollout's token limit and temperature, judged also by the
    recipe's reward functions."""
    from grpo.build import build_for_sampling

    rows = heldout_rows(config, examples)
    parts = build_for_sampling(config, rows)
    settings = settings_for(config, samples)
    args = (parts.policy, parts.tokenizer, rows, parts.prompt_format)
    try:
        if config.rollout.tools:
            return evaluate_with_tools(*args, config.rollout, settings, parts.rewards)
        return evaluate(*args, settings, parts.rewards)
    finally:
        parts.rewards.close()
