"""Math answer extraction and equivalence: a table of gold/prediction pairs, matches and near
misses, through the same path the accuracy reward uses (worker process + hard time limit)."""

from __future__ import annotations

import threading
from fractions import Fraction

import pytest

from grpo.rewards import RewardError
from grpo.rewards.accuracy import (
    AccuracyReward,
    MathVerifier,
    answers_match,
    as_number,
    equivalent_in_process,
    extract_answer,
    normalise,
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
    # LaTeX thousands separators and spacing as MATH writes them (misses found on MATH-500)
    ("11,\\! 111,\\! 111,\\! 100", "11111111100", True),
    ("10,\\!080", "x = 10,\\!080", True),
    ("10{,}080", "10080", True),
    (
        "\\begin{pmatrix} -1/3 \\\\ 2/3 \\end{pmatrix}",
        "\\begin{pmatrix}-1/3\\\\2/3\\end{pmatrix}",
        True,
    ),
    (
        "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}",
        "\\begin{pmatrix}-1&0\\\\0&-1\\end{pmatrix}",
        True,
    ),
    ("4210_{5}", "4210_5", True),
    ("0.5", "50\\%", True),
    ("2000", "2 \\times 10^3", True),
    ("18", "18 kg", True),
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
    # a word after the number that changes its value is not a unit
    ("18", "18 thousand", False),
    ("18", "18 hundred", False),
    ("18", "$18 thousand", False),
    # a gold equation keeps the prediction's left side: "y = 5" does not answer "x = 5"
    ("x = 5", "y = 5", False),
    ("18", "18k", False),
    ("3", "3 dozen", False),
    ("2", "2 and a half", False),
    ("5", "5 squared", False),
    # a numeral in another base (math-verify drops the base)
    ("52_8", "52_9", False),
    ("52_8", "42", False),
    # a base on one side only: math-verify would drop it and call these equal
    ("52_8", "52", False),
    ("52", "52_8", False),
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
        ("no digits at all", ("last_number",), None),
        ("unbalanced \\boxed{1", ("boxed",), None),
        ("cut off \\boxed{12", ("boxed",), None),
        ("So we add them.\nThe answer is 3.5. Done", ("sentence",), "3.5"),
        ("the answer is unclear.\nFinal answer: $\\frac{1}{2}$.", ("sentence",), "$\\frac{1}{2}$"),
        ("The answer is **18**.", ("sentence",), "18"),
        ("The answer is XIV.", ("sentence",), "XIV"),  # a Roman numeral keeps its letters
        # the last box of several, \\fbox too, whatever braces come before it
        ("\\boxed{1} first, then \\boxed{2}", ("boxed",), "2"),
        ("\\fbox{1} first, then \\fbox{2}", ("boxed",), "2"),
        ("\\frac{1}{2} or \\fbox{3}", ("boxed",), "3"),
        # only the answer tag looks inside for a box (<answer>\\boxed{5}</answer>); GSM8K's
        # marker is taken whole
        ("#### \\boxed{12}", ("hashes",), "\\boxed{12}"),
    ],
)
def test_extraction(text: str, strategies: tuple[str, ...], expected: str | None):
    assert extract_answer(text, strategies) == expected


@pytest.mark.parametrize(
    ("gold", "prediction", "expected"),
    [
        ("\\sqrt{2}", "2^{1/2}", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("\\boxed{3}", "3", True),  # a boxed side is not boxed again
        ("[1,3]", "[1,3)", False),
        ("x+1", "", False),  # nothing parsed on one side
        ("3", "\\boxed{3", False),  # an unclosed box (a cut-off answer) is no answer
    ],
)
def test_in_process_check_agrees_with_the_verifier(gold: str, prediction: str, expected: bool):
    # `grpo eval` checks answers in its own process (equivalent_in_process), the reward runner
    # in worker processes (MathVerifier): the same verdicts
    assert equivalent_in_process(gold, prediction) is expected


def test_in_process_check_is_bounded_on_the_main_thread_and_answers_off_it(monkeypatch):
    # math-verify's time limits use signal.alarm: on the main thread each parse and the
    # comparison get timeout_s (5 s unless told); on another thread math-verify refuses a
    # limit (ValueError), so none is passed and the check still answers
    import math_verify

    limits: list[tuple[str, dict]] = []

    def spy(name: str, real):
        def call(*args, **kwargs):
            limits.append((name, kwargs))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(math_verify, "parse", spy("parse", math_verify.parse))
    monkeypatch.setattr(math_verify, "verify", spy("verify", math_verify.verify))

    def expected(limit: int | None) -> list[tuple[str, dict]]:
        parse = ("parse", {"parsing_timeout": limit})
        return [parse, parse, ("verify", {"timeout_seconds": limit})]

    assert equivalent_in_process("\\frac{1}{2}", "0.5")
    assert limits == expected(5)
    limits.clear()
    assert equivalent_in_process("\\frac{1}{2}", "0.5", timeout_s=2)
    assert limits == expected(2)

    limits.clear()
    verdicts: list[bool] = []
    worker = threading.Thread(
        target=lambda: verdicts.append(equivalent_in_process("\\frac{1}{2}", "0.5"))
    )
    worker.start()
    worker.join()
    assert verdicts == [True]
    assert limits == expected(None)


def test_closing_the_reward_closes_its_verifier():
    plain = AccuracyReward(math_verify=False)
    assert plain(["<answer>7</answer>"], answer=["7"]) == [1.0]
    plain.close()  # no workers: nothing to close, no error
    reward = AccuracyReward(processes=1)
    reward.close()
    with pytest.raises(RuntimeError, match="math verifier is closed"):
        reward(["<answer>\\frac{1}{2}</answer>"], answer=["0.5"])


def test_a_percentage_on_either_side_reads_as_a_fraction():
    # 50% = 0.5 whichever side writes the percent sign; a different value is still wrong
    assert answers_match("0.5", "50%", None) and answers_match("50%", "0.5", None)
    assert answers_match("0.5", "50\\%", None)
    assert not answers_match("0.3", "50%", None)
    assert not answers_match("30%", "0.5", None)


def test_a_value_word_after_a_dollar_amount_is_not_waved_through_by_the_symbolic_check():
    # math-verify tells "$18 thousand" from 18 anyway; a checker that says yes to anything shows
    # the scaled-number rule itself rejects it, with a currency sign inside the number too
    def says_yes(gold: str, prediction: str) -> bool:
        return True

    for prediction, gold in [
        ("$18 thousand", "18"),
        ("18 thousand", "18"),
        ("-$18 thousand", "-18"),
    ]:
        assert not answers_match(prediction, gold, says_yes), prediction
    assert answers_match("-$18", "-18", None)


def test_answers_are_normalised_before_comparing():
    # without math-verify, only normalisation can make these equal
    assert answers_match("x+1.", "x+1", None)
    assert answers_match("$x+1$", "x+1", None)
    assert not answers_match("x+2", "x+1", None)
    plain = AccuracyReward(math_verify=False)
    assert plain(["<answer>x+1.</answer>"], answer=["x+1"]) == [1.0]


def test_normalise_removes_delimiters_escaped_dollars_and_spacing_commands():
    assert normalise("\\(x+1\\)") == "x+1" and normalise("\\[x+1\\]") == "x+1"
    # thin and negative spaces go; a control space stays a space
    assert normalise("x\\,+\\!1") == "x+1"
    assert normalise("5\\ \\text{cm}") == "5 \\text{cm}"
    assert answers_match("\\$18", "18", None)
    # Roman numerals keep their letters: XIX is not XI
    assert normalise("$XIX$") == "XIX" and normalise("XIX.") == "XIX"
    assert not answers_match("XIX", "XI", None)


def test_a_value_word_is_one_whatever_its_case():
    assert not answers_match("18 Thousand", "18", None)
    assert not answers_match("18 MILLION", "18", None)


def test_numerals_in_a_base_compare_their_digits_in_either_case():
    # hexadecimal digits: 1a_16 and 1A_{16} are the same numeral
    assert answers_match("1a_16", "1A_{16}", None) and answers_match("1A_{16}", "1a_16", None)
    assert not answers_match("1b_16", "1A_{16}", None)


def test_answers_up_to_the_length_limit_are_compared():
    # MAX_ANSWER_CHARS = 1000: an answer that long still matches, a longer one never does
    assert answers_match("1" * 1000, "1" * 1000, None)
    assert not answers_match("1" * 1001, "1" * 1001, None)


def test_as_number_is_exact():
    assert as_number("1,000.5") == as_number("2001/2")
    assert as_number("1,00") is None  # not a thousands pattern
    assert as_number("abc") is None
    # the docstring's plain numbers
    assert [as_number(t) for t in ("$18", "50%", "7 apples", "3/4", "-3.5")] == [
        18,
        50,
        7,
        Fraction(3, 4),
        Fraction(-7, 2),
    ]
    # a period after the number (a sentence's end) and a leading decimal point
    assert as_number("1,000.") == 1000 and as_number(".5") == Fraction(1, 2)
    # only a trailing percent sign is dropped: "10%X" is no number
    assert as_number("10%X") is None


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
    texts = ["<answer>7</answer>", "it is probably 7", "<answer>7</answer>"]
    golds = ["7", "7", None]
    assert plain(texts, answer=golds) == [1.0, 0.0, None]
    assert fallback(texts, answer=golds) == [1.0, 1.0, None]
    assert plain(["<answer>7</answer>"], answer=["  "]) == [None]  # a blank gold is no gold
    assert plain(texts, answer=[None, "7", "7"]) == [None, 0.0, 1.0]  # each row on its own
    assert plain(texts) == [None, None, None]  # no answer column: not applicable
    with pytest.raises(ValueError):  # one gold per completion, or no score at all
        plain(texts, answer=["7"])
    # math_verify: false means no symbolic check at all, in this process or any other
    assert plain(["<answer>\\frac{1}{2}</answer>"], answer=["0.5"]) == [0.0]


def test_an_unknown_extraction_names_the_known_ones():
    known = "known: answer, boxed, hashes, sentence, last_number"
    with pytest.raises(RewardError, match=f"unknown extract \\['tea_leaves'\\] \\({known}\\)"):
        AccuracyReward(extract=["tea_leaves"])


def test_accuracy_reward_builds_its_verifier_from_its_arguments():
    # workers start on first use: building the reward starts none
    assert (AccuracyReward().verifier.processes, AccuracyReward().verifier.timeout_s) == (2, 5.0)
    tuned = AccuracyReward(processes=3, timeout_s=1.5).verifier
    assert (tuned.processes, tuned.timeout_s) == (3, 1.5)
