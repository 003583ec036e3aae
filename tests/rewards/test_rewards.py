"""Reward functions and the runner: values on hand-made completions, fallbacks, time limits."""

from __future__ import annotations

import math

import pytest

from grpo.config import RewardsConfig, RewardSpec
from grpo.rewards import REGISTRY, RewardError, RewardRunner, resolve_reward
from grpo.rewards.builtin import tag_credit, tag_names
from grpo.rewards.copying import copy_tokens, field_free_ngrams, ngrams, template_ngrams
from grpo.rewards.countdown import InvalidExpression, countdown_correct, evaluate_expression
from grpo.rewards.length import repeated_fraction, soft_overlong


def _runner(*specs: RewardSpec, **config) -> RewardRunner:
    return RewardRunner(RewardsConfig(functions=list(specs), **config))


def test_format_strict_and_configurable_values():
    fn = resolve_reward(RewardSpec(name="format", args={"reward": 1.0, "penalty": -1.0}))
    texts = [
        "<think>a</think>\n<answer>1</answer>",
        "<answer>1</answer>",
        "<think>a</think><answer>1</answer> extra",
    ]
    assert fn(texts) == [1.0, -1.0, -1.0]


def test_format_tags_are_configurable():
    answer_only = resolve_reward(RewardSpec(name="format", args={"tags": ["answer"]}))
    both = resolve_reward(RewardSpec(name="format", args={"tags": ["<think>", "<answer>"]}))
    texts = [
        "<answer>5</answer>",  # the answer tag alone
        " <think>2+3</think> <answer>5</answer>\n",  # the seed's format, whitespace around
        "<answer>5</answer> because",  # text after the last tag
        "The sum is <answer>5</answer>",  # text before the first tag
    ]
    assert answer_only(texts) == [1.0, 0.0, 0.0, 0.0]
    assert both(texts) == [0.0, 1.0, 0.0, 0.0]


def test_format_sections_may_span_lines():
    fn = resolve_reward(RewardSpec(name="format"))
    assert fn(["<think>step 1\nstep 2</think>\n<answer>\n3\n</answer>"]) == [1.0]


def test_format_sections_hold_no_tag_marks():
    # a gemma run's completion: a second </think> inside the think section is no format
    fn = resolve_reward(RewardSpec(name="format"))
    texts = [
        "<think> 19 </think> 17 </think> <answer> 19 </answer>",
        "<think> a <answer> b </answer> c </think> <answer> 1 </answer>",
        "<think> x </think> <answer> 1 <answer> 2 </answer>",
        "<think> <thinking> is fine </think> <answer> 1 </answer>",  # another tag's name
    ]
    assert fn(texts) == [0.0, 0.0, 0.0, 1.0]


def test_format_tags_keep_every_letter_of_their_names():
    # only brackets, slashes and spaces around a name are dropped; an X in a name stays
    assert tag_names(["<think>", "</answer>", " XML "]) == ("think", "answer", "XML")
    fn = resolve_reward(RewardSpec(name="format", args={"tags": ["TEX"]}))
    assert fn(["<TEX>x^2</TEX>", "<TE>x^2</TE>"]) == [1.0, 0.0]


def test_format_tags_must_be_names():
    with pytest.raises(RewardError, match="format tags"):
        resolve_reward(RewardSpec(name="format", args={"tags": ["a b"]}))
    with pytest.raises(RewardError, match="format tags"):
        resolve_reward(RewardSpec(name="tag_count", args={"tags": []}))


R1_PLACEHOLDERS = "<think> reasoning process here </think> <answer> answer here </answer>"


def test_format_refuses_completions_that_copy_the_template():
    fn = resolve_reward(RewardSpec(name="format", args={"copied_from": "r1_zero"}))
    plain = resolve_reward(RewardSpec(name="format"))
    texts = [
        R1_PLACEHOLDERS,  # R1-Zero's own example: well formed, and no reasoning
        "<think> reasoning process here </think> <answer> 30 </answer>",  # the think copied
        "<think>The user asks a question: 23 + 7</think><answer>30</answer>",  # 4 words of it
        "<think> 23 + 7 = 30 </think> <answer> 30 </answer>",  # 3 tokens in a row at most
        "<think>The answer is 30.</think><answer>30</answer>",
    ]
    assert plain(texts) == [1.0] * 5
    assert fn(texts) == [0.0, 0.0, 0.0, 1.0, 1.0]
    # a template given as text, and a shorter run of its words
    own = "Solve it. Show your work in <think> tags. {prompt}"
    strict = resolve_reward(RewardSpec(name="format", args={"copied_from": own, "copy_ngram": 2}))
    assert strict(["<think>show your sums</think><answer>1</answer>"]) == [0.0]
    assert strict(["<think>3 and 4</think><answer>7</answer>"]) == [1.0]
    # tag_count: a copy earns no partial credit either
    count = resolve_reward(RewardSpec(name="tag_count", args={"copied_from": "r1_zero"}))
    assert count([R1_PLACEHOLDERS, "<think> 23 + 7 = 30 </think>"]) == [0.0, 0.5]
    with pytest.raises(RewardError, match="format: copy_ngram must be at least 2"):
        resolve_reward(RewardSpec(name="format", args={"copied_from": "r1_zero", "copy_ngram": 1}))
    # a misspelt name, or a run longer than the template, would refuse nothing: said at once
    for args in ({"copied_from": "r1zero"}, {"copied_from": "r1_zero", "copy_ngram": 500}):
        # the message says what to give instead
        fix = "give a built-in template's name \\(r1_zero\\) or the template's text"
        with pytest.raises(RewardError, match=f"has no run of .*; {fix}"):
            resolve_reward(RewardSpec(name="tag_count", args=args))
    # "{{" is a literal brace, as the template renders it: "{json}" is the template's own text
    braces = resolve_reward(
        RewardSpec(
            name="format",
            args={"copied_from": "Reply as {{json}} here. {prompt}", "copy_ngram": 2},
        )
    )
    assert braces(["<think>json here</think><answer>1</answer>"]) == [0.0]


def test_copy_ngrams_are_every_run_of_n_tokens_and_never_span_the_question():
    assert ngrams(["a", "b", "c"], 2) == {("a", "b"), ("b", "c")}  # the last run too, none shorter
    assert ngrams(["a"], 2) == set()
    assert copy_tokens("See <think> 2+3 </THINK>!") == ["see", "<think>", "2", "3", "</think>"]
    rendered = "Answer now. What is 2 + 3? Think first."
    own = template_ngrams(rendered, ["  What is 2 + 3?  "], 2)  # the row's text, stripped
    assert ("answer", "now") in own and ("think", "first") in own
    assert not own & {("now", "what"), ("what", "is"), ("3", "think")}  # the question cut out


def test_a_templates_own_ngrams_are_cut_at_its_fields():
    # "Solve it now. " | {prompt} | " Then show work.": no run spans the field ("now then")
    assert field_free_ngrams("Solve it now. {prompt} Then show work.", 2) == {
        ("solve", "it"),
        ("it", "now"),
        ("then", "show"),
        ("show", "work"),
    }
    # not a format string (a lone "{"): the whole text is the template's own, braces dropped
    assert field_free_ngrams("Reply as JSON {like this", 2) == {
        ("reply", "as"),
        ("as", "json"),
        ("json", "like"),
        ("like", "this"),
    }


def test_format_answer_pattern_asks_for_a_number():
    fn = resolve_reward(RewardSpec(name="format", args={"answer_pattern": "-?[0-9]+"}))
    texts = [
        "<think> + </think> <answer> + </answer>",  # well formed and empty of meaning
        "<think> 23 + 7 </think> <answer> 30 </answer>",
        "<think> 2 - 5 </think> <answer>-3</answer>",
        "<think> a </think> <answer>30 apples</answer>",
    ]
    assert fn(texts) == [0.0, 1.0, 1.0, 0.0]
    answer_only = resolve_reward(
        RewardSpec(name="format", args={"tags": ["answer"], "answer_pattern": "[A-D]"})
    )
    assert answer_only(["<answer> B </answer>", "<answer>E</answer>"]) == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"format: answer_pattern: '\(' is not a regular"):
        resolve_reward(RewardSpec(name="format", args={"answer_pattern": "("}))
    # a pattern an empty answer matches would pay <answer> </answer>, the hack it is there for
    with pytest.raises(RewardError, match="matches an empty answer"):
        resolve_reward(RewardSpec(name="format", args={"answer_pattern": "-?[0-9]*"}))


@pytest.mark.parametrize(
    ("text", "tags", "credit"),
    [
        ("<answer>5</answer>", ["answer"], 1.0),
        ("<answer>5", ["answer"], 0.5),  # opened, never closed
        ("<answer>5</answer>", ["think", "answer"], 0.5),
        ("</answer><answer>", ["answer"], 0.5),  # the closing mark before the opening one
    ],
)
def test_tag_count_with_configured_tags(text: str, tags: list[str], credit: float):
    fn = resolve_reward(RewardSpec(name="tag_count", args={"tags": tags}))
    assert fn([text]) == [credit]


@pytest.mark.parametrize(
    ("text", "credit"),
    [
        ("<think>a</think><answer>1</answer>", 1.0),
        ("<think>a</think> 1", 0.5),  # two of four tags
        ("</think><answer>1</answer>", 0.75),  # <think> missing
        ("<think><think>a</think><answer>1</answer>", 0.75),  # doubled <think> earns nothing
        ("<answer>1</answer><think>a</think>", 0.5),  # the later pair is out of order
        ("plain", 0.0),
    ],
)
def test_tag_credit(text: str, credit: float):
    assert tag_credit(text) == credit


@pytest.mark.parametrize(
    ("answer", "numbers", "target", "ok"),
    [
        ("(3 + 5) * 2", [2, 3, 5], 16, True),
        ("3 + 5 * 2", [2, 3, 5], 16, False),  # 13
        ("(3 + 5) * 2 = 16", [2, 3, 5], 16, True),
        ("(3 + 3) * 2", [2, 3, 5], 12, False),  # 3 used twice, 5 unused
        ("8 * 2", [2, 3, 5], 16, False),  # 8 not given
        ("6 / (1 - 3/4)", [6, 1, 3, 4], 24, True),  # exact fractions: 6 / (1/4) = 24
        ("__import__('os').system('true')", [1], 1, False),
        ("2 ** 3", [2, 3], 8, False),  # power is not allowed
        ("5 / (3 - 3)", [5, 3, 3], 0, False),  # division by zero
        ("3 * 5", [2, 3, 5], 15, False),  # every number must be used by default: 2 is not
        ("3 × 5 ÷ 5 × 2", [2, 3, 5, 5], 6, True),  # the signs models write
        ("3 \\times 5 \\div 5 \\times 2", [2, 3, 5, 5], 6, True),  # and in LaTeX
    ],
)
def test_countdown(answer: str, numbers: list[int], target: int, ok: bool):
    assert countdown_correct(answer, numbers, target) is ok


def test_countdown_subset_option_and_evaluation():
    assert countdown_correct("3 * 5", [2, 3, 5], 15, use_all=False)
    assert not countdown_correct("3 * 5", [2, 3, 5], 15, use_all=True)
    value, used = evaluate_expression("(7 - 1) / 4")
    assert value == 1.5 and used == [7, 1, 4]
    fn = resolve_reward(RewardSpec(name="countdown"))
    assert fn(["<answer>2*(3+5)</answer>", "16"], numbers=[[2, 3, 5]] * 2, target=[16, 16]) == [
        1.0,
        0.0,
    ]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty or too long"),
        (" = 16", "empty or too long"),
        ("10" + "+1" * 100, "empty or too long"),  # 202 characters, past the 200 allowed
        ("3 +", "invalid syntax (<unknown>, line 1)"),
        ("__import__('os').system('true')", "Call is not allowed"),
        ("2 ** 3", "BinOp is not allowed"),
        ("5 / (3 - 3)", "division by zero"),
    ],
)
def test_invalid_expressions_say_why(text: str, why: str):
    with pytest.raises(InvalidExpression) as err:
        evaluate_expression(text)
    assert str(err.value) == why


def test_the_longest_expression_allowed_is_evaluated():
    value, used = evaluate_expression("10" + "+1" * 99)  # 200 characters
    assert value == 109 and len(used) == 100


def test_soft_overlong_matches_dapo():
    # max 10, buffer 4: free up to 6; 8 tokens -> (6 - 8) / 4 = -0.5; 10 -> -1; 11 -> -1
    assert [soft_overlong(n, 10, 4) for n in (6, 8, 10, 11)] == [0.0, -0.5, -1.0, -1.0]
    fn = resolve_reward(RewardSpec(name="overlong", args={"max_length": 10, "buffer": 4}))
    assert fn(["a", "b"], completion_ids=[[1] * 5, [1] * 7]) == [0.0, -0.25]
    with pytest.raises(RewardError):
        resolve_reward(RewardSpec(name="overlong", args={"max_length": 10, "buffer": 0}))
    with pytest.raises(RewardError, match="bad args"):
        resolve_reward(RewardSpec(name="overlong"))


def test_token_budget():
    fn = resolve_reward(
        RewardSpec(name="token_budget", args={"budget": 4, "per_token": 0.1, "max_penalty": 0.5})
    )
    # 3 tokens: 0; 6 tokens: 2 over -> -0.2; 20 tokens: 16 over -> -1.6 floored at -0.5
    assert fn(["", "", ""], completion_ids=[[1] * 3, [1] * 6, [1] * 20]) == pytest.approx(
        [0.0, -0.2, -0.5]
    )


def test_repetition():
    # "a b a b a b" trigrams: aba, bab, aba, bab -> 2 distinct of 4 -> 0.5 repeated
    assert repeated_fraction(["a", "b", "a", "b", "a", "b"], 3) == 0.5
    assert repeated_fraction([1, 2, 3, 4], 2) == 0.0
    assert repeated_fraction([1], 3) == 0.0
    fn = resolve_reward(RewardSpec(name="repetition", args={"n": 3, "max_penalty": -2.0}))
    assert fn(["a b a b a b", "one two three four"], completion_ids=[[], []]) == [-1.0, 0.0]


def test_builtins_registered():
    resolve_reward(RewardSpec(name="format"))
    assert {
        "format",
        "tag_count",
        "accuracy",
        "code",
        "countdown",
        "overlong",
        "token_budget",
        "repetition",
        "reward_model",
    } <= set(REGISTRY)


def test_unknown_reward_and_bad_args():
    with pytest.raises(RewardError, match="unknown reward") as raised:
        resolve_reward(RewardSpec(name="nope"))
    # the message lists the built-ins to choose from
    assert "built-ins: accuracy, code, " in str(raised.value)
    assert str(raised.value).endswith("; or module:function)")
    with pytest.raises(RewardError, match="unknown extract"):
        resolve_reward(RewardSpec(name="accuracy", args={"extract": ["tea_leaves"]}))
    with pytest.raises(RewardError, match="mode"):
        resolve_reward(RewardSpec(name="code", args={"mode": "sometimes"}))
    for name, below in {"cpu_s": 0, "wall_s": 0.001, "memory_mb": 1, "max_procs": 0}.items():
        with pytest.raises(RewardError, match=rf"'code': {name} must be at least"):
            resolve_reward(RewardSpec(name="code", args={name: below}))


def test_a_right_program_passes_at_the_code_rewards_smallest_limits():
    from grpo.rewards.code import LIMIT_FLOORS

    score = resolve_reward(RewardSpec(name="code", args=LIMIT_FLOORS))
    program = "```python\ndef add(a, b):\n    return a + b\n```"
    assert score([program], tests=[["assert add(1, 2) == 3"]]) == [1.0]


def test_accuracy_and_code_through_the_runner():
    runner = _runner(
        RewardSpec(name="accuracy"),
        RewardSpec(name="code", args={"cpu_s": 2, "wall_s": 4}),
        workers=4,
    )
    try:
        out = runner(
            ["<answer>\\frac{1}{2}</answer>", "```python\ndef f():\n    return 1\n```"],
            ["p", "p"],
            {"answer": ["0.5", None], "tests": [None, ["assert f() == 1"]]},
            [[1], [1]],
        )
    finally:
        runner.close()
    # NaN where not applicable (None): accuracy has no gold for row 1, code no tests for row 0
    assert out.per_function[0, 0] == 1.0 and out.per_function[1, 1] == 1.0
    assert math.isnan(out.per_function[0, 1]) and math.isnan(out.per_function[1, 0])


def test_a_column_a_built_in_reads_must_be_in_the_data():
    # without it accuracy (or code) would score None for every completion, all run long
    runner = _runner(RewardSpec(name="accuracy"), RewardSpec(name="code"), workers=1)
    try:
        runner.check_columns([{"prompt": "p", "answer": "1"}, {"prompt": "q", "tests": ["t"]}])
        with pytest.raises(RewardError, match=r"'accuracy' reads the column 'answer', which no"):
            runner.check_columns([{"prompt": "p", "solution": "2", "tests": ["t"]}])
        with pytest.raises(RewardError, match=r"'code' reads the column 'tests'"):
            runner.check_columns([{"prompt": "p", "answer": "1"}])
    finally:
        runner.close()
