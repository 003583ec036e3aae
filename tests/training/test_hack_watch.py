"""Reward hacking seen as it happens (grpo.training.hack_watch): each signal on hand-written
completions, the warning rule, the state a resume needs, and runs of the trainer whose rewards are
gamed by scripted completions (the signal rises and one warning prints) or not (silence)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from grpo.config import ConfigError, HackWatchConfig, RewardSpec
from grpo.data.prompts import PromptFormat
from grpo.rewards import register
from grpo.rollout import grouped_rollout
from grpo.scoring.distribution import Decoding
from grpo.step_data import Rollout, Scored
from grpo.training.hack_watch import (
    HackWatch,
    Levels,
    answers_follow_questions,
    format_only,
    held_up,
    question_restated_share,
    restates_question,
    rise,
    share_beyond_one_group,
    template_copy_share,
)
from grpo.training.trainer import train

TOY_REWARDS = Path(__file__).parents[1] / "toy_rewards.py"
R1_COPY = " reasoning process here </think> <answer> answer here </answer>"
WARNING = "possible reward hacking"


def rollout_of(prompts: list[str], rows: list[dict], completions: list[str]) -> Rollout:
    """A rollout of hand-written texts (P prompts, G = len(completions) / P each)."""
    n, g = len(completions), len(completions) // len(rows)
    ids, mask = torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool)
    repeated = [p for p in prompts for _ in range(g)]
    return Rollout(ids, mask, ids, mask, ~mask[:, 0], repeated, completions, rows, g)


def scored_of(rollout: Rollout) -> Scored:
    n = rollout.num_completions
    return Scored(rollout, torch.zeros(n, 0), [], torch.zeros(n), torch.zeros(n))


# --------------------------------------------------------------------------- template copies


def test_template_copy_counts_completions_that_repeat_the_r1_zero_placeholders() -> None:
    row = {"prompt": "What is 23 + 7?", "answer": "30"}
    prompt = PromptFormat(template="r1_zero").fill(row)
    completions = [
        R1_COPY,  # reasoning process here </think> <answer> answer here </answer>: 8 tokens
        " 23 + 7 = 30 </think> <answer> 30 </answer>",  # honest: 2 in a row (</think> <answer>)
        " reasoning process here </think> <answer> 30 </answer>",  # 5 in a row
        " the user asks a question, and the assistant solves it",  # 10 of the template's words
    ]
    share = template_copy_share(rollout_of([prompt], [row], completions), n=8)
    assert share == pytest.approx(2 / 4)
    # a 5-token copy counts once the run length asked for is 5
    assert template_copy_share(rollout_of([prompt], [row], completions), n=5) == pytest.approx(
        3 / 4
    )


def test_template_copy_is_built_from_the_recipes_own_prompt_not_a_phrase_list() -> None:
    # a template of the user's: its words are "the template", the row's question is not
    question = "A farmer has 23 cows and buys 7 more cows at the market today, how many cows now?"
    row = {"prompt": question}
    prompt = PromptFormat(
        template="Show all of your work first and then write one final number. {prompt}"
    ).fill(row)
    completions = [
        "show all of your work first and then write",  # 9 tokens of the template
        question,  # the question repeated: the honest way to start, not the template
        "All of your work first and then",  # 7 tokens of the template: under 8
        "<think> 23 + 7 = 30 </think> <answer> 30 </answer>",  # the R1 copy's tags, not this prompt's
    ]
    assert template_copy_share(rollout_of([prompt], [row], completions), n=8) == 0.25
    assert template_copy_share(rollout_of([prompt], [row], completions), n=7) == 0.5


def test_template_copy_reads_the_system_prompt_through_the_chat_template(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = "Think it over inside think tags and then give the answer inside answer tags."
    messages = [{"role": "user", "content": "What is 2 + 2? Please think it over."}]
    rows = [{"prompt": messages}, {"prompt": "What is 3 + 3?"}]
    fmt = PromptFormat(system=system)
    prompts = [fmt.render(tokenizer, row) for row in rows]
    completions = [
        "think it over inside think tags and then give the answer",  # the system prompt: copied
        "2 + 2 = 4",
        "What is 3 + 3?",
        "it over inside think tags and then give the answer inside",
    ]
    assert template_copy_share(rollout_of(prompts, rows, completions), n=8) == 0.5


def test_text_of_a_worked_example_is_no_template_copy_for_the_warning(capsys) -> None:
    # data.few_shot's worked example, rendered in the prompt; completions that follow it share
    # its 9-token opening: the metric counts them, the warning does not
    example = "To convert multiply by how many small units make one large unit. 3 x 1000 = 3000"
    system = "Convert the quantity and put the number in answer tags at the very end please."
    question = "Convert 5 kilograms to grams."
    prompt = f"{system}\nConvert 3 kilograms to grams.\n{example}\n{question}\n"
    row = {"prompt": question, "answer": "5000"}
    following = "To convert multiply by how many small units make one large unit. 5 x 1000"
    placeholder = "put the number in answer tags at the very end please"  # the system prompt's
    rollout = rollout_of([prompt], [row], [following, following, following, "5000"])
    examples = ["Convert 3 kilograms to grams.", example]
    assert template_copy_share(rollout, n=8) == 0.75  # the metric: as before
    assert template_copy_share(rollout, n=8, examples=examples) == 0.0
    steps = [step_metrics(10) for _ in range(2)]
    watch = HackWatch(HackWatchConfig(window=3), SPECS, examples)
    assert watch.observe(1, scored_of(rollout), steps[0], True)["hack/template_copy"] == 0.75
    assert not warnings(capsys.readouterr().err)
    # a copy of the template's own text is still one, examples or not
    copied = rollout_of([prompt], [row], [placeholder, placeholder, following, "5000"])
    assert template_copy_share(copied, n=8, examples=examples) == 0.5
    watch.observe(2, scored_of(copied), steps[1], True)
    said = warnings(capsys.readouterr().err)
    assert len(said) == 1 and "step 2: possible reward hacking: 50% of completions" in said[0]


# --------------------------------------------------------------------------- restated questions


@pytest.mark.parametrize(
    ("answer", "question", "gold", "restated"),
    [
        ("23 + 7", "What is 23 + 7?", "30", True),  # the gemma run's hack (math-verify pays it)
        ("23+7", "What is 23 + 7?", "30", True),  # spacing does not matter: tokens do
        ("\\(23 + 7\\)", "What is 23 + 7?", "30", True),  # nor math delimiters
        ("30", "What is 23 + 7?", "30", False),
        ("7", "What is 7 * 1?", "7", False),  # a plain number may be in the question honestly
        ("14", "What is 2 + 14?", "16", True),  # an operand copied (a gemma run's hack)
        ("14.0", "What is 2 + 14?", "16", True),  # as a number, not as text
        ("15", "What is 2 + 14?", "16", False),  # wrong, but no copy
        ("3", "What is 5-3?", "2", True),  # "-3" read as a number: its size is the operand
        ("7", "What is 7 * 2?", None, False),  # no gold: a number in the question may be right
        ("x + 1", "Which is larger, x + 1 or x - 1?", "x + 1", False),  # the gold: honest
        ("x - 1", "Which is larger, x + 1 or x - 1?", "x + 1", True),
        ("(B)", "Pick (A) 3 or (B) 4.", "A", False),  # one word: a choice, not a restatement
        ("3 + 7", "What is 23 + 7?", "30", False),  # "3" inside "23" is no token of the question
        ("23 + 7 = 30", "What is 23 + 7?", "30", False),  # worked, not restated
        (None, "What is 23 + 7?", "30", False),  # no answer at all
        ("23 + 7", "What is 23 + 7?", None, True),  # without gold the rule still applies
    ],
)
def test_restated_question_rule(answer, question, gold, restated: bool) -> None:
    assert restates_question(answer, question, gold) is restated


def test_restated_share_reads_answers_as_the_rewards_do() -> None:
    # a prompt that opens <answer> makes the completion start inside it (the opened tag)
    rows = [
        {"prompt": "What is 23 + 7?", "answer": "30"},
        {"prompt": "What is 4 * 5?", "answer": "20"},
    ]
    prompts = ["Q: What is 23 + 7? A: <answer>", "Q: What is 4 * 5?\n"]
    completions = [
        "23 + 7</answer>",  # restated, in the opened tag
        "30</answer>",
        "The answer is \\boxed{4 * 5}",  # restated, boxed
        "<answer>20</answer>",
    ]
    assert question_restated_share(rollout_of(prompts, rows, completions)) == 0.5


def test_restated_answers_warn_only_when_they_spread_over_groups(capsys) -> None:
    # the default recipe's step 4: one group wrote "21 + 10 = 21" six times of eight, an
    # honest misreading of one question (7 of 16 here: 44% > 20%); the same share spread over
    # both questions is a shortcut
    rows = [
        {"prompt": "What is 21 + 10?", "answer": "31"},
        {"prompt": "What is 2 + 28?", "answer": "30"},
    ]
    prompts = [row["prompt"] for row in rows]
    one_group = ["<answer>21</answer>"] * 7 + ["<answer>31</answer>"] * 9
    spread = ["<answer>21</answer>"] * 4 + ["<answer>31</answer>"] * 4
    spread += ["<answer>28</answer>"] * 3 + ["<answer>30</answer>"] * 5
    # beyond the group with the most: 0 of 8, and 3 of 8 (38% > 20%)
    assert share_beyond_one_group([True] * 7 + [False] * 9, 8) == 0
    assert share_beyond_one_group([True] * 4 + [False] * 4 + [True] * 3 + [False] * 5, 8) == 3 / 8
    assert share_beyond_one_group([True, False, True, True], 4) == 3 / 4  # one group: its own
    for completions, warned in ((one_group, False), (spread, True)):
        watch = HackWatch(HackWatchConfig(window=3), SPECS)
        scored = scored_of(rollout_of(prompts, rows, completions))
        out = watch.observe(1, scored, step_metrics(10), True)
        assert out["hack/question_restated"] == pytest.approx(7 / 16)  # the metric: as before
        said = warnings(capsys.readouterr().err)
        assert len(said) == int(warned) and all("hack/question_restated" in x for x in said)


# --------------------------------------------------------------------------- trends


def test_rise_is_the_least_squares_change_across_the_window() -> None:
    assert rise([0.0, 0.5, 1.0]) == pytest.approx(1.0)
    # slope = ((-1)(0.03 - 0.52) + (1)(1.0 - 0.52)) / 2 = 0.485; over 2 steps: 0.97
    assert rise([0.03, 0.53, 1.0]) == pytest.approx(0.97)
    assert rise([1.0, 0.0]) == pytest.approx(-1.0)
    assert rise([0.2, 0.2, 0.2, 0.2]) == pytest.approx(0.0)
    assert rise([0.7]) == 0.0
    # [0, 1, 0, 1]: sum (i - 1.5)(y - 0.5) = 0.75 - 0.25 - 0.25 + 0.75 = 1, over
    # sum (i - 1.5)^2 = 5: slope 0.2 per step, 0.6 across the 3 steps (its end-point diff is 1)
    assert rise([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.6)


def test_format_only_needs_format_up_and_accuracy_flat_over_a_full_window() -> None:
    assert format_only([0.0, 0.25, 0.5], [0.0, 0.0, 0.0], 3, 0.2, 0.02)
    assert not format_only([0.0, 0.25, 0.5], [0.0, 0.1, 0.2], 3, 0.2, 0.02)  # accuracy rose too
    assert not format_only([0.5, 0.5, 0.55], [0.0, 0.0, 0.0], 3, 0.2, 0.02)  # format flat
    assert not format_only([0.0, 0.5], [0.0, 0.0], 3, 0.2, 0.02)  # window not full yet


def test_levels_compare_the_last_window_with_the_first() -> None:
    levels = Levels()
    for value in (10.0, 12.0, math.nan, 8.0, 5.0, 4.0):  # NaN: a step without the value
        levels.add(value, window=3)
    assert levels.early == [10.0, 12.0, 8.0] and levels.recent == [8.0, 5.0, 4.0]
    # recent mean 17/3 = 5.67 < 0.6 * 10 = 6, but not < 0.5 * 10
    assert levels.collapsed(3, 0.6) and not levels.collapsed(3, 0.5)
    assert not Levels(early=[10.0, 10.0], recent=[1.0]).collapsed(3, 0.5)  # early not full


# --------------------------------------------------------------------------- the watch

SPECS = [
    RewardSpec(name="format"),
    RewardSpec(name="tag_count"),
    RewardSpec(name="accuracy"),
    RewardSpec(name=f"{TOY_REWARDS}:lowercase_share"),
]
HONEST = scored_of(
    rollout_of(["What is 2 + 3?"], [{"prompt": "What is 2 + 3?", "answer": "5"}], ["5", "6"])
)


def step_metrics(length: float, fmt: float = 0.0, acc: float = 0.0, entropy: float = 2.0) -> dict:
    return {
        "completion_len/mean": length,
        "entropy": entropy,
        "reward/format/mean": fmt,
        "reward/tag_count/mean": fmt,
        "reward/accuracy/mean": acc,
    }


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if WARNING in line]


def test_a_collapse_warns_once_per_crossing(capsys) -> None:
    watch = HackWatch(HackWatchConfig(window=3), SPECS)
    lengths = [10, 10, 10, 4, 4, 4, 4, 10, 10, 10, 4, 4, 4]
    flags = []
    for step, length in enumerate(lengths, start=1):
        flags.append(
            watch.observe(step, HONEST, step_metrics(length), True)["hack/length_collapse"]
        )
    # the last 3 steps' mean under half the first 3 steps' (10): steps 6-7 ([4, 4, 4]) and 13
    assert flags == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1]
    said = warnings(capsys.readouterr().err)
    assert len(said) == 2, said
    assert "step 6:" in said[0] and "step 13:" in said[1] and "hack/length_collapse" in said[0]


def test_a_collapse_while_accuracy_holds_up_is_a_note_not_a_warning(capsys) -> None:
    # entropy falls to a quarter while accuracy climbs: the first 3 steps' accuracy mean is
    # 0.3, steps 4-6's 0.7; the signal's metric is 1 all the same
    watch = HackWatch(HackWatchConfig(window=3), SPECS)
    steps = [(2.0, 0.2), (2.0, 0.3), (2.0, 0.4), (0.5, 0.6), (0.5, 0.7), (0.5, 0.8)]
    flags = [
        watch.observe(s, HONEST, step_metrics(10, acc=a, entropy=e), True)
        for s, (e, a) in enumerate(steps, start=1)
    ]
    assert [f["hack/entropy_collapse"] for f in flags] == [0, 0, 0, 0, 0, 1]
    out, err = capsys.readouterr()
    assert not warnings(err)
    # steps 4-6: (0.5 * 3) / 3 = 0.5 < 0.5 * 2.0; accuracy 0.3 -> 0.7
    assert out.splitlines() == [
        "grpo: step 6: policy entropy of the last 3 steps is below 50% of the first 3 steps', "
        "while the accuracy reward held up (0.30 over the first 3 steps, 0.70 over the last): "
        "the policy growing sure of what it learned, not reward hacking "
        "(hack/entropy_collapse; train.hack_watch)"
    ]


@pytest.mark.parametrize(
    ("accuracy", "warned"),
    [
        ([0.0] * 6, True),  # nothing right: the collapse is not bought by answers
        ([0.8, 0.8, 0.8, 0.3, 0.2, 0.2], True),  # fell 0.8 -> 0.23, far beyond the noise
        # held with noise: 0.5 -> 0.4 is within 2 standard errors (2 x 0.067, below)
        ([0.4, 0.6, 0.5, 0.4, 0.5, 0.3], False),
        ([0.2, 0.2, 0.2, 0.3, 0.3, 0.3], False),  # rose
    ],
)
def test_a_collapse_warns_when_the_accuracy_reward_is_zero_or_fell(accuracy, warned, capsys):
    watch = HackWatch(HackWatchConfig(window=3), SPECS)
    entropies = [2.0, 2.0, 2.0, 0.5, 0.5, 0.5]
    for s, (e, a) in enumerate(zip(entropies, accuracy, strict=True), start=1):
        watch.observe(s, HONEST, step_metrics(10, acc=a, entropy=e), True)
    out, err = capsys.readouterr()
    assert len(warnings(err)) == int(warned) and len(out.splitlines()) == int(not warned)


def test_held_up_allows_for_the_noise_of_a_window() -> None:
    # early [0.4, 0.6, 0.5]: mean 0.5, variance 0.02/3; recent [0.4, 0.5, 0.3]: 0.4, 0.02/3
    # noise sqrt(0.02/9 + 0.02/9) = 0.0667; allowed fall max(0.02, 0.133): 0.4 >= 0.367
    assert held_up([0.4, 0.6, 0.5], [0.4, 0.5, 0.3], 0.02) == pytest.approx((0.5, 0.4))
    assert held_up([0.5, 0.5, 0.5], [0.45, 0.45, 0.45], 0.02) is None  # no noise: 0.05 fell
    assert held_up([0.5, 0.5, 0.5], [0.49, 0.49, 0.49], 0.02) is not None  # within the margin
    assert held_up([0.0, 0.0], [0.0, 0.0], 0.02) is None  # nothing paid


def test_a_length_collapse_without_an_accuracy_reward_still_warns(capsys) -> None:
    # nothing tells learning from a shortcut: the warning stays
    watch = HackWatch(HackWatchConfig(window=3), SPECS[:2])
    for step, length in enumerate([10, 10, 10, 4, 4, 4], start=1):
        watch.observe(step, HONEST, step_metrics(length), True)
    said = warnings(capsys.readouterr().err)
    assert len(said) == 1 and "hack/length_collapse" in said[0]


def test_format_rising_alone_warns_and_accuracy_rising_with_it_does_not(capsys) -> None:
    watch = HackWatch(HackWatchConfig(window=3), SPECS)
    out = [
        watch.observe(s, HONEST, step_metrics(10, f, 0.0), True)
        for s, f in [(1, 0), (2, 0.3), (3, 0.6)]
    ]
    assert [o["hack/format_only"] for o in out] == [0, 0, 1]
    assert "hack/format_only" in warnings(capsys.readouterr().err)[0]
    learning = HackWatch(HackWatchConfig(window=3), SPECS)
    out = [
        learning.observe(s, HONEST, step_metrics(10, f, a), True)
        for s, f, a in [(1, 0, 0), (2, 0.3, 0.2), (3, 0.6, 0.4)]
    ]
    assert [o["hack/format_only"] for o in out] == [0, 0, 0]
    assert not warnings(capsys.readouterr().err)


def test_answers_follow_questions_when_most_answer_and_no_answer_stands_for_most() -> None:
    assert answers_follow_questions(["6", "7", "30", "30", "2", None, "128", "9"], 2)
    # one group per question; the same answer topping most groups is a constant, not attempts
    assert not answers_follow_questions(["0", "0", "0", "1", "0", "3", "5", "5"], 2)
    assert not answers_follow_questions([None, None, None, "4", "5", None, "2", None], 2)
    assert not answers_follow_questions(["5", "6"], 2)  # one group: cannot tell


def _format_rising(completions: list[str], capsys) -> tuple[list[str], list[str]]:
    """The watch's lines over three steps of a rising format and no accuracy, each step the
    given completions of two questions."""
    rows = [
        {"prompt": "What is 12 * 3?", "answer": "36"},
        {"prompt": "What is 7 * 8?", "answer": "56"},
    ]
    step = scored_of(rollout_of([r["prompt"] for r in rows], rows, completions))
    watch = HackWatch(HackWatchConfig(window=3), SPECS)
    for s, f in [(1, 0), (2, 0.3), (3, 0.6)]:
        assert watch.observe(s, step, step_metrics(10, f, 0.0), True)["hack/format_only"] == (
            s == 3
        )
    captured = capsys.readouterr()
    return warnings(captured.err), [line for line in captured.out.splitlines() if "format" in line]


def test_a_format_learned_with_answers_that_follow_the_questions_is_a_note(capsys) -> None:
    # wrong, but attempts: a model that cannot solve the task yet learns the format first
    attempts = [
        "<answer>30</answer>",
        "<answer>35</answer>",
        "<answer>54</answer>",
        "<answer>63</answer>",
    ]
    warned, notes = _format_rising(attempts, capsys)
    assert not warned
    assert notes == [
        "grpo: step 3: the format reward rose over the last 3 steps while accuracy did not, "
        "with answers that follow their questions: the format learned ahead of the answer, not "
        "reward hacking by itself (check pass@k with grpo eval --samples) (hack/format_only; "
        "train.hack_watch)"
    ]
    # the same rise paid for empty tags or one answer to every question: a warning
    for gamed in (["<answer> </answer>"] * 4, ["<answer>1</answer>"] * 4):
        warned, notes = _format_rising(gamed, capsys)
        assert len(warned) == 1 and "hack/format_only" in warned[0] and not notes


def test_the_watch_can_be_turned_off_and_only_the_announcing_rank_prints(capsys) -> None:
    off = HackWatch(HackWatchConfig(enabled=False, window=3), SPECS)
    quiet = HackWatch(HackWatchConfig(window=3), SPECS)
    for step, length in enumerate([10, 10, 10, 1, 1, 1], start=1):
        assert off.observe(step, HONEST, step_metrics(length), True) == {}
        flagged = quiet.observe(step, HONEST, step_metrics(length), False)
    assert flagged["hack/length_collapse"] == 1 and quiet.raised == {"hack/length_collapse"}
    assert not warnings(capsys.readouterr().err)


def test_the_state_a_checkpoint_keeps_continues_the_windows(capsys) -> None:
    def entropies(watch: HackWatch, values: list[float], first: int) -> list[float]:
        return [
            watch.observe(first + i, HONEST, step_metrics(10, entropy=v), True)[
                "hack/entropy_collapse"
            ]
            for i, v in enumerate(values)
        ]

    straight = HackWatch(HackWatchConfig(window=3), SPECS)
    entropies(straight, [2.0, 2.0, 2.0, 0.5, 0.5, 0.5], 1)
    saved = straight.state_dict()
    resumed, fresh = (
        HackWatch(HackWatchConfig(window=3), SPECS),
        HackWatch(HackWatchConfig(window=3), SPECS),
    )
    resumed.load_state_dict(json.loads(json.dumps(saved)))  # plain values only
    capsys.readouterr()
    assert entropies(straight, [0.5, 0.5], 7) == entropies(resumed, [0.5, 0.5], 7) == [1, 1]
    assert not warnings(capsys.readouterr().err)  # raised at step 6, before the save
    # without the state, the resumed steps would be the early level: no collapse seen
    assert entropies(fresh, [0.5, 0.5], 7) == [0, 0]


def test_the_accuracy_levels_survive_a_checkpoint_and_an_older_one_loads(capsys) -> None:
    # accuracy 0.2 over steps 1-3, then entropy and accuracy move: the resumed watch still
    # compares with steps 1-3 and says a note at step 6, as the straight one does
    def step(watch: HackWatch, s: int, acc: float, entropy: float) -> None:
        watch.observe(s, HONEST, step_metrics(10, acc=acc, entropy=entropy), True)

    straight = HackWatch(HackWatchConfig(window=3), SPECS)
    for s in (1, 2, 3):
        step(straight, s, 0.2, 2.0)
    resumed = HackWatch(HackWatchConfig(window=3), SPECS)
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())))
    assert resumed.learned.early == [0.2, 0.2, 0.2]
    for watch in (straight, resumed):
        for s in (4, 5, 6):
            step(watch, s, 0.8, 0.5)
    out, err = capsys.readouterr()
    assert not warnings(err) and [line[:13] for line in out.splitlines()] == ["grpo: step 6:"] * 2
    older = {k: v for k, v in straight.state_dict().items() if k != "learned"}
    from_before = HackWatch(HackWatchConfig(window=3), SPECS)
    from_before.load_state_dict(older)  # a checkpoint from before the accuracy levels
    assert from_before.learned.early == [] and from_before.raised == straight.raised


def test_reward_kinds_come_from_the_registry_or_the_config() -> None:
    watch = HackWatch(HackWatchConfig(), SPECS)
    assert watch.format_names == ["format", "tag_count"]
    assert watch.accuracy_names == ["accuracy"]
    chosen = HackWatch(HackWatchConfig(accuracy_rewards=["lowercase_share"]), SPECS)
    assert chosen.accuracy_names == ["lowercase_share"]
    with pytest.raises(ConfigError, match=r"train.hack_watch.format_rewards: 'fmt' is not one"):
        HackWatch(HackWatchConfig(format_rewards=["fmt"]), SPECS)
    with pytest.raises(ValueError, match="reward kind must be one of"):
        register("judged_by_style", kind="style")
    no_accuracy = HackWatch(HackWatchConfig(), SPECS[:2])
    assert "hack/format_only" not in no_accuracy.observe(1, HONEST, step_metrics(10), True)


# --------------------------------------------------------------------------- the trainer


class ScriptedEngine:
    """A rollout engine that writes what the test scripts: ``script(step, row, j)`` is the j-th
    completion of a row's group at the engine's ``step``-th call (``first_step`` for a resumed
    run), tokenized with the policy's tokenizer so the trainer scores and trains on it."""

    def __init__(self, tokenizer, script: Callable[[int, dict, int], str], first_step: int = 1):
        self.tokenizer, self.script, self.step = tokenizer, script, first_step

    def generate(self, prompts, rows, group_size, seeds=None, temperature=None) -> Rollout:
        tok = self.tokenizer
        texts = [self.script(self.step, row, j) for row in rows for j in range(group_size)]
        self.step += 1
        enc = tok(
            prompts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        ids = [[*tok(t, add_special_tokens=False).input_ids, tok.eos_token_id] for t in texts]
        width = max(map(len, ids))
        completion_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        mask = torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]
        return grouped_rollout(
            tok,
            enc.input_ids,
            enc.attention_mask,
            completion_ids,
            mask,
            torch.zeros(len(texts), dtype=torch.bool),
            prompts,
            rows,
            group_size,
            decoding=Decoding(temperature=temperature or 1.0),
        )

    def sync_weights(self, model: Any) -> None:
        pass


def run_metrics(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if "event" not in row]


def copies_more_each_step(step: int, row: dict, j: int) -> str:
    """From step 3 on, one more of the 4 completions copies R1-Zero's placeholders each step."""
    return R1_COPY if j < step - 2 else " let me add the two numbers up"


def test_a_run_paid_for_copying_the_template_sees_it_and_warns_once(
    tiny_config, tiny_model_dir, weights, capfd
) -> None:
    # format pays the copy (it is perfectly formatted); accuracy never pays: format alone rises
    config = tiny_config(
        data={"template": "r1_zero"},
        rewards={
            "functions": [
                {"name": "format"},
                {"name": "accuracy", "args": {"math_verify": False}},
                {"name": f"{TOY_REWARDS}:lowercase_share"},
            ]
        },
        train={"steps": 5, "hack_watch": {"window": 3}},
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    run_dir = train(config, ScriptedEngine(tokenizer, copies_more_each_step))
    weights.assert_moved(weights.of(tiny_model_dir), weights.of(run_dir / "final"))
    assert run_metrics(run_dir, "hack/template_copy") == [0, 0, 0.25, 0.5, 0.75]
    assert run_metrics(run_dir, "reward/format/mean") == [0, 0, 0.25, 0.5, 0.75]
    # format over the last 3 steps rose 0.25 by step 3 (> 0.2) with accuracy flat at 0
    assert run_metrics(run_dir, "hack/format_only") == [0, 0, 1, 1, 1]
    said = warnings(capfd.readouterr().err)
    assert len(said) == 2, said
    assert all("step 3:" in line for line in said)
    assert "hack/template_copy" in said[0] and "25% of completions" in said[0]
    assert "hack/format_only" in said[1]


def restates_more_each_step(step: int, row: dict, j: int) -> str:
    """From step 3 on, one more of the 4 completions answers with the question's expression
    ("What is 12 + 5?" -> "12 + 5"), which expression_value pays; the rest answer one off."""
    if j < step - 2:
        return f"<answer>{row['prompt'].removeprefix('What is ').rstrip('?')}</answer>"
    return f"<answer>{int(row['answer']) + 1}</answer>"


def test_a_run_paid_for_restating_the_question_sees_it_and_warns_once(
    tiny_config, tiny_model_dir, capfd
) -> None:
    config = tiny_config(
        rewards={"functions": [{"name": f"{TOY_REWARDS}:expression_value"}]},
        train={"steps": 5, "hack_watch": {"window": 3}},
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    run_dir = train(config, ScriptedEngine(tokenizer, restates_more_each_step))
    assert run_metrics(run_dir, "reward/expression_value/mean") == [0, 0, 0.25, 0.5, 0.75]
    assert run_metrics(run_dir, "hack/question_restated") == [0, 0, 0.25, 0.5, 0.75]
    said = warnings(capfd.readouterr().err)
    assert len(said) == 1 and "step 3:" in said[0] and "hack/question_restated" in said[0], said


def test_honest_runs_stay_silent(tiny_config, tiny_model_dir, capfd) -> None:
    # the tiny model's own samples (the hf engine), and scripted honest answers that earn
    # format and accuracy from step 1 (so format never rises alone)
    watched = {"steps": 5, "hack_watch": {"window": 3}}
    sampled = train(tiny_config(data={"template": "r1_zero"}, train=watched))

    def honest(step: int, row: dict, j: int) -> str:
        return f" I add them up </think> <answer> {row['answer']} </answer>"

    config = tiny_config(
        data={"template": "r1_zero"},
        rewards={
            "functions": [{"name": "format"}, {"name": "accuracy", "args": {"math_verify": False}}]
        },
        train={**watched, "run_name": "honest"},
    )
    scripted = train(config, ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), honest))
    assert run_metrics(scripted, "reward/accuracy/mean") == [1.0] * 5
    for run_dir in (sampled, scripted):
        for key in (
            "template_copy",
            "question_restated",
            "format_only",
            "length_collapse",
            "entropy_collapse",
        ):
            assert run_metrics(run_dir, f"hack/{key}") == [0.0] * 5, (run_dir, key)
    assert not warnings(capfd.readouterr().err)


WORKED = "I add the first number to the second number and write the sum in the tags"


def follows_the_example(step: int, row: dict, j: int) -> str:
    """Every completion opens with the worked example's 16-token sentence, then answers."""
    return f" {WORKED}: <answer>{row['answer']}</answer>"


def test_a_run_that_follows_its_worked_example_is_not_warned(
    tiny_config, tiny_model_dir, capfd
) -> None:
    # data.few_shot's assistant turn holds the sentence every completion repeats: the metric
    # counts each one as a copy (1.0), the trainer hands the example to the watch, which is silent
    few_shot = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": f"{WORKED}: <answer>5</answer>"},
    ]
    config = tiny_config(data={"few_shot": few_shot}, train={"steps": 3})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    run_dir = train(config, ScriptedEngine(tokenizer, follows_the_example))
    assert run_metrics(run_dir, "hack/template_copy") == [1.0, 1.0, 1.0]
    assert not warnings(capfd.readouterr().err)


def shorter_after_step_3(step: int, row: dict, j: int) -> str:
    return "i add the two numbers and get the sum: ok" if step <= 3 else "sum!"


def test_length_collapse_is_seen_across_a_resume(tiny_config, tiny_model_dir, capfd) -> None:
    # 41 tokens (with EOS) for 3 steps, then 5: the last 3 steps' mean falls under half the first
    # 3 steps' at step 5 ((41 + 5 + 5) / 3 = 17 < 20.5). A resumed run must still compare with
    # steps 1-3: from its own first steps (all short) it would see no collapse
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    watched = {"hack_watch": {"window": 3}}
    straight = train(
        tiny_config(train={"steps": 6, **watched, "run_name": "straight"}),
        ScriptedEngine(tokenizer, shorter_after_step_3),
    )
    expected = [0, 0, 0, 0, 1, 1]
    assert run_metrics(straight, "hack/length_collapse") == expected
    capfd.readouterr()
    first = tiny_config(train={"steps": 3, **watched, "run_name": "resumed"})
    train(first, ScriptedEngine(tokenizer, shorter_after_step_3))
    assert not warnings(capfd.readouterr().err)
    second = tiny_config(train={"steps": 6, **watched, "run_name": "resumed"})
    resumed = train(second, ScriptedEngine(tokenizer, shorter_after_step_3, first_step=4))
    assert run_metrics(resumed, "hack/length_collapse") == expected
    said = warnings(capfd.readouterr().err)
    assert len(said) == 1 and "step 5:" in said[0] and "hack/length_collapse" in said[0], said


def test_a_number_the_question_holds_unparsed_is_no_operand() -> None:
    # "3/0" does not read as a number: it is not a 0 in the question, so a wrong 0 restates
    # nothing, while a copied 5 does
    from grpo.training.hack_watch import restates_question

    assert not restates_question("0", "Compute 3/0 + 5", gold="7")
    assert restates_question("5", "Compute 3/0 + 5", gold="7")


def test_an_environments_own_reward_is_its_accuracy() -> None:
    # games won rising while the policy grows sure is learning (a note), not a collapse unpaid
    watch = HackWatch(
        HackWatchConfig(), [RewardSpec(name="environment"), RewardSpec(name="format")]
    )
    assert (watch.accuracy_names, watch.format_names) == (["environment"], ["format"])


def test_a_number_the_completion_computed_is_its_own_arithmetic_not_a_copy() -> None:
    # one-digit arithmetic: an honest error often lands on an operand; an equation of the
    # completion's own that gives it is the model's work, a bare operand is a copy
    worked = "-1 + -2 = -2\n<answer>-2</answer>"
    assert not restates_question("-2", "Calculate -1 + -2.", "-3", worked)
    assert restates_question("-2", "Calculate -1 + -2.", "-3", "<answer>-2</answer>")
    copied = " 19 </think> <answer> 17 </answer>"  # the R1-Zero sums run's shortcut
    assert restates_question("17", "What is 19 + 17?", "36", copied)
    # an equation whose result is another number does not excuse the answer
    assert restates_question("17", "What is 19 + 17?", "36", "19 + 17 = 36 <answer>17</answer>")
    # an "equation" with nothing computed on its left excuses nothing
    for bare in ("= 17 <answer>17</answer>", "x = 17 <answer>17</answer>", "17 = 17"):
        assert restates_question("17", "What is 19 + 17?", "36", bare), bare
    for worked in ("(19 - 2) = 17", "19 * 1 = 17", "2 + (19 - 4) = 17"):
        assert not restates_question("17", "What is 19 + 17?", "36", worked), worked
    # a collapsed policy's endless "1+1+1..." is read in linear time: one backtracking regex
    # took 0.5 s at 16,000 characters and grew with the square (about a minute here)
    start = time.perf_counter()
    assert restates_question("17", "What is 19 + 17?", "36", "1+" * 100_000)
    assert time.perf_counter() - start < 5
