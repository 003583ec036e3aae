"""Countdown verifier: does the answer expression reach the target using the given numbers?

The expression is parsed with ``ast`` and evaluated by a tiny interpreter over exact fractions
that knows only numbers, + - * / and parentheses: model text is never passed to ``eval``.
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from fractions import Fraction
from typing import Any

from grpo.rewards.accuracy import extract_answer
from grpo.rewards.registry import RewardFn, register

MAX_EXPRESSION_CHARS = 200
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class InvalidExpression(ValueError):
    """Not an arithmetic expression over integer literals."""


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise InvalidExpression("division by zero")
        return OPERATORS[type(node.op)](left, right)
    raise InvalidExpression(f"{type(node).__name__} is not allowed")


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """(exact value, integer literals used) of an arithmetic expression; InvalidExpression else."""
    text = text.replace("×", "*").replace("÷", "/").replace("\\times", "*").replace("\\div", "/")
    text = text.split("=")[0].strip()  # "3 * 8 - 4 = 20" -> the left side
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise InvalidExpression("empty or too long")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as err:
        raise InvalidExpression(str(err)) from None
    used: list[int] = []
    return _evaluate(tree, used), used


def countdown_correct(answer: str, numbers: list[int], target: int, use_all: bool = True) -> bool:
    """True when ``answer`` equals ``target`` and uses each given number once (all of them when
    ``use_all``, else any subset)."""
    try:
        value, used = evaluate_expression(answer)
    except InvalidExpression:
        return False
    available, spent = Counter(int(n) for n in numbers), Counter(used)
    if any(spent[n] > available[n] for n in spent):
        return False
    if use_all and spent != available:
        return False
    return value == target


@register("countdown", kind="accuracy")
def countdown_reward(
    use_all: bool = True, numbers_field: str = "numbers", target_field: str = "target"
) -> RewardFn:
    """1 when the <answer> expression reaches the target with the row's numbers, else 0."""

    def score(completions: list[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        numbers_column = columns.get(numbers_field) or [None] * n
        targets = columns.get(target_field) or [None] * n
        out: list[float | None] = []
        for text, numbers, target in zip(completions, numbers_column, targets, strict=True):
            if numbers is None or target is None:
                out.append(None)
                continue
            answer = extract_answer(text, ("answer",))
            out.append(
                float(
                    answer is not None and countdown_correct(answer, numbers, int(target), use_all)
                )
            )
        return out

    return score
