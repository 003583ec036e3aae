"""Copies of a prompt's own text in a completion, counted in tokens (words, numbers and tags such
as ``</think>``; lower-cased; punctuation left out). Shared by the format reward, which refuses to
pay a copied template, and the reward-hacking watch, which counts the copies."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

COPY_TOKEN_RE = re.compile(r"</?\w+>|\w+")


def copy_tokens(text: str) -> list[str]:
    return COPY_TOKEN_RE.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def text_ngrams(parts: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """The n-grams of ``parts``, none spanning two of them."""
    return set().union(*(ngrams(copy_tokens(part), n) for part in parts))


def template_ngrams(rendered: str, questions: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """The n-grams of a rendered prompt's own text: ``rendered`` cut at each of the row's texts
    (an n-gram never spans the question)."""
    parts = [rendered]
    for question in questions:
        question = question.strip()
        if question:
            parts = [piece for part in parts for piece in part.split(question)]
    return text_ngrams(parts, n)


def field_free_ngrams(template: str, n: int) -> set[tuple[str, ...]]:
    """The n-grams of a template's own text, cut at its fields (``{prompt}``; ``{{`` is a
    literal brace, as when the template is rendered)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:  # not a format string: all of it is the template's own text
        return text_ngrams([template], n)
    parts = [""]
    for text, field, *_ in parsed:  # "{{" ends a piece of literal text, a field ends a part
        parts[-1] += text
        if field is not None:
            parts.append("")
    return text_ngrams(parts, n)


def copies(text: str, source: set[tuple[str, ...]], n: int) -> bool:
    """``text`` holds ``n`` tokens in a row of the text ``source`` holds the n-grams of."""
    return not ngrams(copy_tokens(text), n).isdisjoint(source)
