"""Reward hacking seen as it happens: five signals computed from each step's completions and
metrics, and one console line when a signal crosses its threshold (``train.hack_watch``).

- ``hack/template_copy``: share of completions that hold ``copy_ngram`` or more consecutive
  tokens (words, numbers, tags such as ``</think>``; lower-cased) of their prompt's own text:
  the rendered prompt with the row's question cut out, so the template, system prompt, few-shot
  turns and chat markup, whatever the recipe uses. R1-Zero's placeholder copy
  ``reasoning process here </think> <answer> answer here </answer>`` is 8 such tokens; an honest
  ``... </think> <answer> 30 </answer>`` shares 2 in a row. Its warning counts without the
  ``data.few_shot`` turns' text: a worked example is there to be imitated.
- ``hack/question_restated``: share of completions whose answer (the accuracy reward's
  extraction: ``<answer>``, ``\\boxed{}``, ``####``, "the answer is") restates the question: its
  tokens (words, numbers, symbols) appear in a row in the question's, and it is none of the
  answers that may honestly sit inside a question: fewer than two words or numbers (a choice
  ``(B)``, a single word), or a match of the row's gold answer. ``<answer>23 + 7</answer>`` for
  "What is 23 + 7?" counts (math-verify pays it as 30). A plain number counts when it is one of
  the question's numbers and not the gold answer: ``<answer>14</answer>`` for "What is 2 + 14?"
  (an operand copied, which a format reward for a numeric answer pays), unless the completion
  wrote it as the result of an equation of its own (`-1 + -2 = -2`: its arithmetic, wrong); without a gold answer
  a plain number never counts (``5`` for "5 * 1" may be right). On word problems an honest
  wrong answer that happens to be one of the question's numbers counts too: the signal is a
  share, and warns only when many completions do it, in the other groups (prompts) as well as
  the one with the most: a group misreading its question (``21 + 10 = 21`` seven times of
  eight) is the model's error, a shortcut spreads.
- ``hack/format_only``: 1 when, over the last ``window`` steps, the format rewards' mean rose by
  more than ``format_rise`` while the accuracy rewards' mean rose by at most ``accuracy_rise``
  (rise: the least-squares slope times the window's span). Which functions are which comes from
  the registry (``register(name, kind=...)``) or the config's lists; logged only when the run has
  both kinds.
- ``hack/length_collapse``, ``hack/entropy_collapse``: 1 when the mean completion length
  (``completion_len/mean``) or policy entropy (``entropy``) of the last ``window`` steps is below
  ``collapse_below`` times its mean over the run's first ``window`` steps.

A rising format with flat accuracy warns only when the answers it pays are no attempts at the
questions: most completions hold no answer, or one answer stands for most questions (a copied
placeholder, a constant). Answers that follow their questions, right or wrong, are a format
learned ahead of the answer, a model that cannot solve the task yet: a note, as below.

A signal warns when it goes above its threshold (the shares: ``copy_above``,
``restated_above``; the flags: when they turn 1), once per crossing: it warns again only after
it has come back down. A collapse while the accuracy rewards held up (their mean over the last
``window`` steps above 0 and not below that of the first ``window`` by more than
``accuracy_rise`` and two standard errors: ``held_up``) is a policy growing sure of what it
learned: it is said as a note on stdout, not a warning. The metrics are the same either way;
only the line differs. The windows and the raised set are saved in checkpoints (``state_dict``), so a
resumed run compares with the same early steps and does not repeat a line it already gave.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from grpo.config import ConfigError, HackWatchConfig, RewardSpec
from grpo.rewards import function_name
from grpo.rewards.accuracy import (
    NUMBER_RE,
    answers_match,
    as_number,
    extract_answer,
    normalise,
)
from grpo.rewards.copying import copies, template_ngrams
from grpo.rewards.inputs import reward_inputs
from grpo.rewards.registry import registered_kind
from grpo.step_data import Rollout, Scored

ANSWER_TOKEN_RE = re.compile(r"\w+|[^\w\s]")  # words, numbers and single symbols (+, =, ^, ...)

# what each signal's warning says; formatted with the value and the config's fields
MESSAGES = {
    "hack/template_copy": "{value:.0%} of completions repeat {copy_ngram}+ words of the prompt's "
    "own text (template, system prompt; data.few_shot's examples aside)",
    "hack/question_restated": "{value:.0%} of completions answer by restating the question",
    "hack/format_only": "the format reward rose over the last {window} steps while accuracy did "
    "not",
    "hack/length_collapse": "mean completion length of the last {window} steps is below "
    "{collapse_below:.0%} of the first {window} steps'",
    "hack/entropy_collapse": "policy entropy of the last {window} steps is below "
    "{collapse_below:.0%} of the first {window} steps'",
}
# signals that a run learning the task shows too: a note when the accuracy held up with them
SETTLING = {"hack/length_collapse", "hack/entropy_collapse"}


# --------------------------------------------------------------------------- template copies


def row_texts(prompt: Any) -> list[str]:
    """A row's own prompt text: the string, or each chat message's content."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        return [str(m.get("content", "")) for m in prompt if isinstance(m, dict)]
    return []


def template_copy_share(rollout: Rollout, n: int, examples: Sequence[str] = ()) -> float:
    """Share of the rollout's completions (the text rewards judge) that copy their prompt's own
    text: ``n`` or more tokens in a row, the texts of ``examples`` (worked examples) cut out
    like the row's question."""
    g = rollout.group_size
    flags = []
    for i, row in enumerate(rollout.rows):
        cut = [*examples, *row_texts(row.get("prompt"))]  # an example may hold a question
        template = template_ngrams(rollout.prompts[i * g], cut, n)
        flags += [copies(text, template, n) for text in rollout.answers[i * g : (i + 1) * g]]
    return sum(flags) / len(flags) if flags else 0.0


# --------------------------------------------------------------------------- restated questions


def answer_tokens(text: str) -> list[str]:
    return ANSWER_TOKEN_RE.findall(normalise(text).lower())


def contains(tokens: list[str], part: list[str]) -> bool:
    """``part`` appears in ``tokens`` as a contiguous run."""
    n = len(part)
    return any(tokens[i : i + n] == part for i in range(len(tokens) - n + 1))


# an equation's left side computes something: an operation on numbers ("3 * (4 + 1)"); a bare
# "= 17" computes nothing and would excuse any copied operand
OPERATION_RE = re.compile(r"[\d)]\s*[-+*/×÷^]\s*[-(]*\s*\.?\d")
RESULT_RE = re.compile(r"\s*(" + NUMBER_RE.pattern + ")")
TAG_RE = re.compile(r"[<>]")


def computed(text: str, number: Fraction) -> bool:
    """Whether ``text`` writes ``number`` as the result of an equation of its own (``-1 + -2 =
    -2``): a wrong answer the model worked out, not an operand copied. The left side is what
    stands between the line's previous ``=`` or tag and this ``=``; read piece by piece, so a
    long line costs linear time (one regex over it backtracked quadratically)."""
    for line in text.splitlines():
        sides = line.split("=")
        for left, right in itertools.pairwise(sides):
            result = RESULT_RE.match(right)
            if result is None or as_number(normalise(result.group(1))) != number:
                continue
            if OPERATION_RE.search(TAG_RE.split(left)[-1]):
                return True
    return False


def restates_question(answer: str | None, question: str, gold: Any = None, text: str = "") -> bool:
    """Whether an extracted answer (of the completion ``text``) restates the question (see the
    module docstring)."""
    if answer is None:
        return False
    known = gold is not None and bool(str(gold).strip())
    if known and answers_match(answer, str(gold), None):
        return False
    number = as_number(normalise(answer))
    if number is not None and computed(text, number):  # its own arithmetic, wrong or not
        return False
    if number is not None:  # an operand copied: one of the question's numbers, and wrong
        # by size: "5-3" reads as 5 and -3, and its operand is 3
        operands = (as_number(n) for n in NUMBER_RE.findall(question))
        return known and abs(number) in {abs(x) for x in operands if x is not None}
    tokens = answer_tokens(answer)
    if sum(t[0].isalnum() for t in tokens) < 2:  # words and numbers, not symbols
        return False
    return contains(answer_tokens(question), tokens)


def answers_and_restated(rollout: Rollout) -> tuple[list[str | None], list[bool]]:
    """Each of the rollout's completions' extracted answer (as the accuracy reward reads it),
    and whether it restates its row's question."""
    texts, prompts, columns, _ = reward_inputs(rollout)
    golds = columns.get("answer") or [None] * len(texts)
    answers = [extract_answer(text) for text in texts]
    flags = [
        restates_question(answer, " ".join(row_texts(prompt)), gold, text)
        for answer, text, prompt, gold in zip(answers, texts, prompts, golds, strict=True)
    ]
    return answers, flags


def question_restated_share(rollout: Rollout) -> float:
    """Share of the rollout's completions whose answer restates its row's question."""
    flags = answers_and_restated(rollout)[1]
    return sum(flags) / len(flags) if flags else 0.0


def answers_follow_questions(answers: Sequence[str | None], group_size: int) -> bool:
    """Whether a step's extracted answers (None: none found) are attempts at their questions:
    most completions answer, and no one answer is the most common in more than half of the
    groups (with a single group, that cannot be told: False)."""
    if sum(a is not None for a in answers) * 2 < len(answers):
        return False
    tops = []
    for i in range(0, len(answers), group_size):
        given = [a for a in answers[i : i + group_size] if a is not None]
        if given:
            tops.append(Counter(given).most_common(1)[0][0])
    return len(tops) >= 2 and Counter(tops).most_common(1)[0][1] * 2 <= len(tops)


def share_beyond_one_group(flags: Sequence[bool], group_size: int) -> float:
    """Share of flagged completions among those of every group but the one with the most
    flags; with one group, among its own."""
    counts = sorted(sum(flags[i : i + group_size]) for i in range(0, len(flags), group_size))
    if len(counts) < 2:
        return sum(flags) / len(flags) if flags else 0.0
    return sum(counts[:-1]) / (len(flags) - group_size)


# --------------------------------------------------------------------------- trends over steps


def rise(values: Sequence[float]) -> float:
    """The change a least-squares line fits across ``values`` (slope x (len - 1)): [0, 0.5, 1]
    rises by 1; 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    slope = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values)) / sum(
        (i - x_mean) ** 2 for i in range(n)
    )
    return slope * (n - 1)


def format_only(
    format_means: Sequence[float],
    accuracy_means: Sequence[float],
    window: int,
    format_rise: float,
    accuracy_rise: float,
) -> bool:
    """Format rewards rose by more than ``format_rise`` over a full window, accuracy by at most
    ``accuracy_rise``."""
    if len(format_means) < window or len(accuracy_means) < window:
        return False
    return rise(format_means) > format_rise and rise(accuracy_means) <= accuracy_rise


def kind_mean(metrics: dict[str, float], names: list[str]) -> float:
    """Mean of ``reward/<fn>/mean`` over ``names`` (those that applied this step); NaN if none."""
    values = [metrics.get(f"reward/{name}/mean", math.nan) for name in names]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


@dataclass
class Levels:
    """A series' first ``window`` values (its early-run level) and its last ``window``."""

    early: list[float] = field(default_factory=list)
    recent: list[float] = field(default_factory=list)

    def add(self, value: float, window: int) -> None:
        if math.isnan(value):  # a step without the value (no update ran): not a level
            return
        if len(self.early) < window:
            self.early.append(value)
        self.recent = [*self.recent, value][-window:]

    def collapsed(self, window: int, below: float) -> bool:
        """The recent mean is under ``below`` times the early one (once the early window is full)."""
        if len(self.early) < window:
            return False
        return sum(self.recent) / len(self.recent) < below * sum(self.early) / len(self.early)


def reward_names_of_kind(
    specs: list[RewardSpec], chosen: list[str] | None, kind: str, key: str
) -> list[str]:
    """The run's reward functions of ``kind``: ``chosen`` when the config lists them (each must
    be one of the run's), else the built-ins registered with that kind."""
    names = [function_name(spec) for spec in specs]
    if chosen is None:
        return [function_name(s) for s in specs if registered_kind(s.name) == kind]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        raise ConfigError(
            f"{key}: '{unknown[0]}' is not one of the run's reward functions ({', '.join(names)})"
        )
    return list(chosen)


def held_up(
    early: Sequence[float], recent: Sequence[float], margin: float
) -> tuple[float, float] | None:
    """The means of ``early`` and ``recent`` (per-step accuracy) when the recent one is above 0
    and did not fall: it is not below the early one by more than ``margin`` and two standard
    errors of the difference (the steps' prompts differ in difficulty, so a window's mean
    moves by itself); None otherwise."""
    first, last = statistics.fmean(early), statistics.fmean(recent)
    noise = math.sqrt(
        statistics.pvariance(early) / len(early) + statistics.pvariance(recent) / len(recent)
    )
    return (first, last) if last > 0 and last >= first - max(margin, 2 * noise) else None


@dataclass(frozen=True)
class Evidence:
    """What decides a step's lines besides its ``hack/*`` metrics, from its completions.

    own_copy: share of completions that copy the template with the worked examples cut out.
    restated_elsewhere: share of answers that restate the question in every group but the one
    with the most: one group's misreading of its question is the model's own error, a shortcut
    shows in the other groups too.
    answers_follow: the step's answers are attempts at their questions
    (``answers_follow_questions``)."""

    own_copy: float
    restated_elsewhere: float
    answers_follow: bool = False  # answers_follow_questions; unknown (no completions): False


@dataclass(frozen=True)
class Said:
    """A line the watch gives at ``step`` for signal ``key``: a warning of possible reward
    hacking, or a note (``warning`` False): a collapse with the accuracy holding up, or a rising
    format whose answers follow their questions."""

    step: int
    key: str
    warning: bool
    text: str


class HackWatch:
    """The signals of each step (``observe``) and their lines (``speak``); ``state_dict`` /
    ``load_state_dict`` for checkpoints. Every rank observes the same gathered step, so every
    rank holds the same state; only the announcing one prints. ``examples``: the texts of the
    worked examples the prompt asks the model to follow (``data.few_shot``)."""

    def __init__(
        self, config: HackWatchConfig, rewards: list[RewardSpec], examples: Sequence[str] = ()
    ) -> None:
        self.cfg = config
        self.examples = [text for text in examples if text.strip()]
        key = "train.hack_watch"
        self.format_names = reward_names_of_kind(
            rewards, config.format_rewards, "format", f"{key}.format_rewards"
        )
        self.accuracy_names = reward_names_of_kind(
            rewards, config.accuracy_rewards, "accuracy", f"{key}.accuracy_rewards"
        )
        self.format: list[float] = []  # the last `window` steps' format and accuracy means
        self.accuracy: list[float] = []
        self.length = Levels()
        self.entropy = Levels()
        self.learned = Levels()  # the accuracy rewards' mean, early and recent
        self.raised: set[str] = set()  # signals above their threshold at the last step

    @property
    def thresholds(self) -> dict[str, float]:
        """A signal warns when it goes above its threshold (the 0/1 flags: when they turn 1)."""
        flag = 0.5
        return {
            "hack/template_copy": self.cfg.copy_above,
            "hack/question_restated": self.cfg.restated_above,
            "hack/format_only": flag,
            "hack/length_collapse": flag,
            "hack/entropy_collapse": flag,
        }

    def observe(
        self, step: int, scored: Scored, metrics: dict[str, float], announce: bool
    ) -> dict[str, float]:
        """The step's ``hack/*`` metrics from its completions and its other ``metrics``; the
        announcing rank prints the step's lines."""
        cfg = self.cfg
        if not cfg.enabled:
            return {}
        window = cfg.window
        rollout = scored.rollout
        copied = template_copy_share(rollout, cfg.copy_ngram)
        answers, restated = answers_and_restated(rollout)
        out = {
            "hack/template_copy": copied,
            "hack/question_restated": sum(restated) / len(restated) if restated else 0.0,
        }
        if self.format_names and self.accuracy_names:
            pair = kind_mean(metrics, self.format_names), kind_mean(metrics, self.accuracy_names)
            if not any(math.isnan(v) for v in pair):
                self.format = [*self.format, pair[0]][-window:]
                self.accuracy = [*self.accuracy, pair[1]][-window:]
            flagged = format_only(
                self.format, self.accuracy, window, cfg.format_rise, cfg.accuracy_rise
            )
            out["hack/format_only"] = float(flagged)
        self.length.add(metrics["completion_len/mean"], window)
        self.entropy.add(metrics.get("entropy", math.nan), window)
        out["hack/length_collapse"] = float(self.length.collapsed(window, cfg.collapse_below))
        out["hack/entropy_collapse"] = float(self.entropy.collapsed(window, cfg.collapse_below))
        own = copied
        if self.examples:
            own = template_copy_share(rollout, cfg.copy_ngram, self.examples)
        follow = answers_follow_questions(answers, rollout.group_size)
        seen = Evidence(own, share_beyond_one_group(restated, rollout.group_size), follow)
        for said in self.speak(step, out, metrics, seen):
            if announce:
                print(said.text, file=sys.stderr if said.warning else sys.stdout, flush=True)
        return out

    def accuracy_held(self) -> tuple[float, float] | None:
        """The accuracy rewards' mean over the first and the last ``window`` steps when it held
        up (see ``held_up``); None when it did not, or is unknown."""
        early, recent = self.learned.early, self.learned.recent
        if len(early) < self.cfg.window:
            return None
        return held_up(early, recent, self.cfg.accuracy_rise)

    def speak(
        self, step: int, values: dict[str, float], metrics: dict[str, float], seen: Evidence
    ) -> list[Said]:
        """The lines of a step whose signals are ``values`` (the ``hack/*`` metrics), whose
        other metrics are ``metrics`` and whose completions showed ``seen``: one for each
        signal that went above its threshold. The template copy counts without the worked
        examples, and restated answers only when the groups but the one with the most hold
        more than ``restated_above`` of them too."""
        if self.accuracy_names:
            self.learned.add(kind_mean(metrics, self.accuracy_names), self.cfg.window)
        spread = seen.restated_elsewhere > self.cfg.restated_above
        decided = {
            **values,
            "hack/template_copy": seen.own_copy,
            "hack/question_restated": values["hack/question_restated"] if spread else 0.0,
        }
        thresholds, held, lines = self.thresholds, self.accuracy_held(), []
        for key, value in decided.items():
            if not value > thresholds[key]:
                self.raised.discard(key)
                continue
            if key in self.raised:
                continue
            self.raised.add(key)
            said = MESSAGES[key].format(value=value, **self.cfg.model_dump())
            if key == "hack/format_only" and seen.answers_follow:
                text = (
                    f"grpo: step {step}: {said}, with answers that follow their questions: the "
                    "format learned ahead of the answer, not reward hacking by itself (check "
                    f"pass@k with grpo eval --samples) ({key}; train.hack_watch)"
                )
                lines.append(Said(step, key, False, text))
                continue
            if key in SETTLING and held is not None:
                text = (
                    f"grpo: step {step}: {said}, while the accuracy reward held up ({held[0]:.2f} "
                    f"over the first {self.cfg.window} steps, {held[1]:.2f} over the last): the "
                    f"policy growing sure of what it learned, not reward hacking ({key}; "
                    "train.hack_watch)"
                )
                lines.append(Said(step, key, False, text))
                continue
            text = (
                f"grpo: warning: step {step}: possible reward hacking: {said} ({key}; "
                "train.hack_watch, docs/rewards.md#reward-hacking)"
            )
            lines.append(Said(step, key, True, text))
        return lines

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": list(self.format),
            "accuracy": list(self.accuracy),
            "length": dataclasses.asdict(self.length),
            "entropy": dataclasses.asdict(self.entropy),
            "learned": dataclasses.asdict(self.learned),
            "raised": sorted(self.raised),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.format = [float(x) for x in state["format"]]
        self.accuracy = [float(x) for x in state["accuracy"]]
        self.length = Levels(**state["length"])
        self.entropy = Levels(**state["entropy"])
        # a checkpoint from before the accuracy levels: they start at the resumed step
        self.learned = Levels(**state.get("learned", {}))
        self.raised = set(state["raised"])
