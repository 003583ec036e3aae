"""Format rewards: the strict seed format and a partial-credit tag count.

(The other built-ins live in their own modules: accuracy in ``accuracy``, countdown in
``countdown``, code in ``code``, length and repetition in ``length``, the reward model in
``reward_model``.)
"""

from __future__ import annotations

import re
from typing import Any

from grpo.data.prompts import template_text
from grpo.rewards.copying import copies, field_free_ngrams
from grpo.rewards.registry import RewardError, RewardFn, register

SEED_TAGS = ("think", "answer")


def tag_names(tags: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Tag names as given (``think`` or ``<think>``), checked: at least one, word characters."""
    names = tuple(t.strip("<>/ ") for t in tags)
    if not names or any(not re.fullmatch(r"\w+", n) for n in names):
        raise RewardError(f"format tags must be names like 'think' or 'answer', got {list(tags)}")
    return names


def format_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    """The whole completion is the tags' sections in order, with only whitespace around them; a
    section holds none of the tags' marks (``<think> a </think> b </think>`` is no format)."""
    names = "|".join(tags)
    inside = rf"(?:(?!</?(?:{names})>).)*"
    body = r"\s*".join(rf"<{t}>{inside}</{t}>" for t in tags)
    return re.compile(rf"^\s*{body}\s*$", re.DOTALL)


def compiled(pattern: str, key: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise RewardError(f"{key}: {pattern!r} is not a regular expression ({err})") from None


def template_copies(copied_from: str | None, n: int, reward: str) -> set[tuple[str, ...]]:
    """The n-grams a completion must not copy: those of the template ``copied_from`` (a built-in
    template's name or a template's text), or none."""
    if n < 2:
        raise RewardError(f"{reward}: copy_ngram must be at least 2, got {n}")
    if not copied_from:
        return set()
    found = field_free_ngrams(template_text(copied_from), n)
    if not found:  # a misspelt template name is taken as a (short) text: nothing would be refused
        raise RewardError(
            f"{reward}: copied_from {copied_from!r} has no run of {n} words (copy_ngram) to refuse; "
            "give a built-in template's name (r1_zero) or the template's text"
        )
    return found


@register("format", kind="format")
def format_reward(
    reward: float = 1.0,
    penalty: float = 0.0,
    tags: list[str] | tuple[str, ...] = SEED_TAGS,
    copied_from: str | None = None,
    copy_ngram: int = 4,
    answer_pattern: str | None = None,
) -> RewardFn:
    """`reward` when the completion is exactly the tagged sections in order (by default
    <think>...</think><answer>...</answer>, the seed's format; `tags: [answer]` asks for the
    answer tag only), else `penalty` (the seed uses -1 or 0). With `answer_pattern` (a regular
    expression), the last section's content, stripped, must match it whole: `-?[0-9]+` asks for
    an integer, so that `<answer> + </answer>` is not a format. With `copied_from` (a template's
    name, such as `r1_zero`, or its text), a completion that repeats `copy_ngram` words, numbers
    or tags in a row of that template's own text earns `penalty` too: R1-Zero's template shows
    the format with placeholders (`<think> reasoning process here </think> <answer> answer here
    </answer>`), and a base model that copies them is well formed without reasoning."""
    names = tag_names(tags)
    pattern = format_pattern(names)
    template = template_copies(copied_from, copy_ngram, "format")
    answer = compiled(answer_pattern, "format: answer_pattern") if answer_pattern else None
    if answer is not None and answer.fullmatch(""):
        raise RewardError(
            f"format: answer_pattern {answer_pattern!r} matches an empty answer, which it is "
            "there to refuse"
        )
    last = re.compile(rf"<{names[-1]}>(.*?)</{names[-1]}>", re.DOTALL)

    def paid(text: str) -> bool:
        if not pattern.match(text) or copies(text, template, copy_ngram):
            return False
        return answer is None or bool(answer.fullmatch(last.findall(text)[-1].strip()))

    def score(completions: list[str], **_: Any) -> list[float | None]:
        return [reward if paid(c) else penalty for c in completions]

    return score


def tag_credit(text: str, tags: tuple[str, ...] = SEED_TAGS) -> float:
    """Share of the tags' opening and closing marks present exactly once and in order
    (<think></think><answer></answer> by default). A mark that appears more than once, or out of
    order, earns nothing."""
    marks = [m for t in tags for m in (f"<{t}>", f"</{t}>")]
    positions = [text.find(m) if text.count(m) == 1 else -1 for m in marks]
    earned, last = 0, -1
    for pos in positions:
        if pos > last:
            earned += 1
            last = pos
    return earned / len(marks)


@register("tag_count", kind="format")
def tag_count_reward(
    reward: float = 1.0,
    tags: list[str] | tuple[str, ...] = SEED_TAGS,
    copied_from: str | None = None,
    copy_ngram: int = 4,
) -> RewardFn:
    """Partial credit: `reward` x (share of the tags' marks present once and in order), so a model
    that never produces the full format still sees a gradient towards it. `copied_from` and
    `copy_ngram` as for `format`: a completion that copies the template earns nothing."""
    names = tag_names(tags)
    template = template_copies(copied_from, copy_ngram, "tag_count")

    def score(completions: list[str], **_: Any) -> list[float | None]:
        return [
            0.0 if copies(c, template, copy_ngram) else reward * tag_credit(c, names)
            for c in completions
        ]

    return score
