"""Math answer extraction and equivalence: a table of gold/prediction pairs, matches and near
misses, through the same path the accuracy reward uses (worker process + hard time limit)."""

from __future__ import annotations

import pytest

from grpo.rewards.accuracy import (
    AccuracyReward,
    MathVerifier,
    answers_match,
    as_number,
    extract_answer,
)


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(processes=1, timeout_s=3.0)
    yield v
    v.close()


# (gold, prediction, expected)
PAIRS = [
    ("18", "18", True),
    ("18", "18.0", True),
    ("18", "$18", True),
    ("18", "\\$18", True),
    ("18", "18 dollars", True),
    ("1000", "1,000", True),
    ("1234567", "1,234,567", True),
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\frac{3}{4}", "0.75", True),
    ("50", "50\\%", True),
    ("-3", "-3", True),
    ("\\sqrt{2}", "2^{1/2}", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", True),
    ("3", "3 \\text{ cm}", True),
    ("\\pi", "\\pi", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("5", "x = 5", True),
    ("\\dfrac{7}{2}", "3.5", True),
    ("10", "\\boxed{10}", True),
    ("[1,3]", "[1,3]", True),
    # near misses
    ("18", "17", False),
    ("18", "180", False),
    ("1000", "1,00", False),
    ("12", "1,2", False),
    ("0.5", "0.55", False),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("\\sqrt{2}", "1.414", False),
    ("-3", "3", False),
    ("[1,3]", "[1,3)", False),
    ("x^2+2x+1", "(x+1)^3", False),
    ("\\pi", "3.14", False),
    ("5", "", False),
    ("7", "seven hundred", False),
]


@pytest.mark.parametrize(("gold", "prediction", "expected"), PAIRS)
def test_equivalence_table(gold: str, prediction: str, expected: bool, verifier: MathVerifier):
    assert answers_match(prediction, gold, verifier.equivalent) is expected


def test_table_size():
    assert len(PAIRS) >= 30
    assert sum(e for *_, e in PAIRS) >= 15 and sum(not e for *_, e in PAIRS) >= 10


@pytest.mark.parametrize(
    ("text", "strategies", "expected"),
    [
        ("<think>..</think><answer> 42 </answer>", ("answer",), "42"),
        ("<answer>1</answer> then <answer>2</answer>", ("answer",), "2"),
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", ("answer",), "\\frac{1}{2}"),
        ("so \\boxed{\\frac{1}{\\sqrt{2}}} done", ("boxed",), "\\frac{1}{\\sqrt{2}}"),
        ("work\n#### 1,234\n", ("hashes",), "1,234"),
        ("I think it is 12, no 13.", ("answer", "boxed"), None),
        ("I think it is 12, no 13.", ("answer", "last_number"), "13"),
        ("unbalanced \\boxed{1", ("boxed",), None),
    ],
)
def test_extraction(text: str, strategies: tuple[str, ...], expected: str | None):
    assert extract_answer(text, strategies) == expected


def test_as_number_is_exact():
    assert as_number("1,000.5") == as_number("2001/2")
    assert as_number("1,00") is None  # not a thousands pattern
    assert as_number("abc") is None


def test_timeout_kills_the_check_and_the_verifier_recovers():
    # 9^(9^(9^9)) makes SymPy compute for far longer than the limit
    v = MathVerifier(processes=1, timeout_s=1.0)
    try:
        with pytest.raises(TimeoutError):
            v.equivalent("9^{9^{9^{9}}}", "1")
        # killed and replaced: the next check works
        assert v.equivalent("\\frac{1}{2}", "0.5")
    finally:
        v.close()


def test_accuracy_reward_gives_none_without_gold_and_uses_last_number_option():
    plain = AccuracyReward(math_verify=False)
    fallback = AccuracyReward(math_verify=False, last_number=True)
    texts = ["<answer>7</answer>", "the answer is 7", "<answer>7</answer>"]
    golds = ["7", "7", None]
    assert plain(texts, answer=golds) == [1.0, 0.0, None]
    assert fallback(texts, answer=golds) == [1.0, 1.0, None]
