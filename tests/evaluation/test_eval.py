"""pass@k / maj@k arithmetic, the evaluation pipeline with a scripted model, the trainer's
eval hook, and `grpo eval`."""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo.cli import main
from grpo.config import RewardsConfig, RewardSpec, build_config
from grpo.data import DataError
from grpo.data.prompts import PromptFormat
from grpo.eval import (
    DEFAULT_EXTRACT,
    EvalSettings,
    evaluate,
    extract_of,
    is_correct,
    k_values,
    majority_answer,
    pass_at_k,
    score_samples,
    settings_for,
)
from grpo.models import load_tokenizer
from grpo.rewards import RewardRunner
from grpo.training.trainer import train

# ------------------------------------------------------------------------------------ pass@k


def test_pass_at_k_hand_examples() -> None:
    # n=4, c=1, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25, abs=1e-12)
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-12)
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252, abs=1e-12)
    # n=4, c=2, k=3: only two wrong ones, so every 3-subset has a correct one
    assert pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0


def test_pass_at_k_matches_enumeration_of_subsets() -> None:
    # the estimator is exactly the share of k-subsets (without replacement) holding a correct one
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_majority_answer() -> None:
    assert majority_answer(["3", "4", " 4", None]) == "4"  # 4 has two votes after stripping
    assert majority_answer(["5", "6"]) == "5"  # tie: the first seen wins
    assert majority_answer([None, "7", None]) == "7"  # no answer casts no vote
    assert majority_answer([None, None]) is None


def test_k_values() -> None:
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(6) == [1, 2, 4, 6]


def test_score_samples_by_hand() -> None:
    samples = [
        # gold 5: one correct of three; the majority (4, twice) is wrong
        ["<answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>"],
        # gold 9: two correct of three, one without an answer tag; majority 9 is right
        ["<answer>9</answer>", "nine", "<answer> 9 </answer>"],
    ]
    out = score_samples(samples, ["5", "9"])
    # pass@1 = mean(c/n) = (1/3 + 2/3) / 2 = 0.5
    assert out["pass@1"] == pytest.approx(0.5, abs=1e-12)
    # pass@2: problem 1: 1 - C(2,2)/C(3,2) = 2/3; problem 2: n-c = 1 < 2 -> 1; mean 5/6
    assert out["pass@2"] == pytest.approx(5 / 6, abs=1e-12)
    assert out["pass@3"] == pytest.approx(1.0, abs=1e-12)
    assert out["maj@3"] == pytest.approx(0.5, abs=1e-12)


# ------------------------------------------------------------------------- scripted model

PROBLEM_RE = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


class ScriptedModel(nn.Module):
    """Answers "What is a op b?" prompts with a fixed policy, through the real tokenizer.

    Greedy: right answers for problems whose first operand a is even, wrong ones otherwise.
    Sampled: the i-th of the k samples answers right when i < a mod 4 (so c = min(a mod 4, k));
    every wrong sample gives the same wrong answer, so a wrong majority is possible.
    """

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.generation_config = type("GC", (), {"eos_token_id": tokenizer.eos_token_id})()
        self.dummy = nn.Parameter(torch.zeros(1))

    def _answer(self, prompt_ids: torch.Tensor, right: bool) -> str:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        a, op, b = PROBLEM_RE.findall(text)[-1]
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        return f"<think>x</think><answer>{value if right else value + 1}</answer>"

    def generate(self, input_ids, attention_mask, num_return_sequences, do_sample, **_):
        outs = []
        for row in input_ids:
            a = int(PROBLEM_RE.findall(self.tokenizer.decode(row))[-1][0])
            for i in range(num_return_sequences):
                right = (i < a % 4) if do_sample else (a % 2 == 0)
                ids = self.tokenizer(self._answer(row, right), add_special_tokens=False).input_ids
                outs.append(torch.cat([row, torch.tensor([*ids, self.tokenizer.eos_token_id])]))
        width = max(len(o) for o in outs)
        pad = self.tokenizer.pad_token_id
        return torch.stack(
            [torch.nn.functional.pad(o, (0, width - len(o)), value=pad) for o in outs]
        )


def test_evaluate_with_scripted_model(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = ScriptedModel(tokenizer).train()
    rows = [  # a: greedy right when even; c = right samples of 3 = min(a mod 4, 3)
        {"prompt": "What is 2 + 3?", "answer": "5"},  # greedy right, c = 2
        {"prompt": "What is 7 - 1?", "answer": "6"},  # greedy wrong, c = 3
        {"prompt": "What is 4 * 4?", "answer": "16"},  # greedy right, c = 0
        {"prompt": "What is 5 + 5?", "answer": "10"},  # greedy wrong, c = 1
    ]
    settings = EvalSettings(samples=3, max_new_tokens=32, batch_size=3)
    out = evaluate(model, tokenizer, rows, PromptFormat(system="sys"), settings)
    assert out["accuracy"] == pytest.approx(2 / 4, abs=1e-12)
    assert out["answer_rate"] == 1.0
    # pass@k = 1 - C(n - c, k) / C(n, k) with n = 3, averaged over the four problems:
    # pass@1 = (2/3 + 1 + 0 + 1/3) / 4 = 0.5
    assert out["pass@1"] == pytest.approx(0.5, abs=1e-12)
    # pass@2: c=2 -> 1, c=3 -> 1, c=0 -> 0, c=1 -> 1 - C(2,2)/C(3,2) = 2/3; mean 2/3
    assert out["pass@2"] == pytest.approx(2 / 3, abs=1e-12)
    assert out["pass@3"] == pytest.approx(3 / 4, abs=1e-12)  # any right sample: 3 of 4
    # maj@3: the right answer wins with c = 2 or 3; with c = 1 the two equal wrong ones win
    assert out["maj@3"] == pytest.approx(2 / 4, abs=1e-12)
    assert out["examples"] == 4
    assert model.training  # evaluation restores the training mode


def test_evaluate_judges_with_the_recipes_rewards(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = ScriptedModel(tokenizer)
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5"},  # greedy right
        {"prompt": "What is 7 - 1?", "answer": "6"},  # greedy wrong
        {"prompt": "What is 4 * 4?", "answer": "16"},  # greedy right
    ]
    rewards = RewardRunner(
        RewardsConfig(
            functions=[
                RewardSpec(name="accuracy", args={"math_verify": False}),
                RewardSpec(name="format", weight=0.5),
            ]
        )
    )
    settings = EvalSettings(max_new_tokens=32, reward_threshold=1.5)
    try:
        out = evaluate(model, tokenizer, rows, PromptFormat(), settings, rewards)
        # totals: right answers 1 + 0.5 (format) = 1.5, the wrong one 0 + 0.5
        assert out["reward/mean"] == pytest.approx((1.5 + 0.5 + 1.5) / 3, abs=1e-6)
        assert out["reward/pass_rate"] == pytest.approx(2 / 3, abs=1e-6)  # totals >= 1.5
        assert out["reward/accuracy/mean"] == pytest.approx(2 / 3, abs=1e-6)
        assert out["reward/format/mean"] == 1.0
        # rows without gold answers: judged by the rewards alone (accuracy's None is left out)
        bare = [{"prompt": r["prompt"]} for r in rows]
        out = evaluate(model, tokenizer, bare, PromptFormat(), settings, rewards)
        assert "accuracy" not in out and math.isnan(out["reward/accuracy/mean"])
        assert out["reward/mean"] == 0.5 and out["reward/pass_rate"] == 0.0
    finally:
        rewards.close()
    with pytest.raises(DataError, match="answer"):
        evaluate(model, tokenizer, bare, PromptFormat(), settings)


def test_eval_stops_at_the_recipes_stop_strings(tiny_model_dir: Path) -> None:
    """Greedy eval ends a completion where training would (``rollout.stop``), so a format reward
    that wants nothing after </answer> judges the same text in both."""
    from transformers import AutoModelForCausalLM

    from grpo.eval import _generate

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = PromptFormat().render(tokenizer, {"prompt": "What is 2 + 3?"})
    settings = EvalSettings(max_new_tokens=24)
    # sampled (the random model's greedy choice is EOS); one token per character, and the same
    # seed draws the same tokens up to the stop
    torch.manual_seed(0)
    [[free]] = _generate(model, tokenizer, [prompt], settings, 1, False)
    stop = free[len(free) // 2]
    torch.manual_seed(0)
    [[stopped]] = _generate(model, tokenizer, [prompt], replace(settings, stop=(stop,)), 1, False)
    assert stopped == free[: free.index(stop) + 1] and len(stopped) < len(free) == 24
    # grpo eval and the trainer's held-out eval take the recipe's stop strings
    assert settings_for(build_config({"rollout": {"stop": ["</answer>"]}}), 1).stop == (
        "</answer>",
    )


# ------------------------------------------------------------------------- trainer and CLI


def test_trainer_logs_eval_and_reflection(tiny_config) -> None:
    config = tiny_config(train={"steps": 3, "eval_every": 2, "eval_examples": 3})
    run_dir = train(config)
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {line["step"]: line for line in lines}
    assert sorted(by_step) == [0, 1, 2, 3]
    # a baseline at step 0, then every eval_every steps and at the last step
    assert {s for s, line in by_step.items() if "eval/accuracy" in line} == {0, 2, 3}
    for step in (0, 2, 3):
        assert 0.0 <= by_step[step]["eval/accuracy"] <= 1.0
        assert by_step[step]["eval/examples"] == 3
    for step in (1, 2, 3):
        assert 0.0 <= by_step[step]["reflection_rate"] <= 1.0


def test_cli_eval_json(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    out_file = tmp_path / "eval.json"
    code = main(
        [
            "eval",
            str(tiny_model_dir),
            "rollout.max_new_tokens=8",
            "--examples",
            "3",
            "--samples",
            "2",
            "--output",
            str(out_file),
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out_file.read_text())
    metrics = printed["metrics"]
    assert set(metrics) >= {"accuracy", "answer_rate", "pass@1", "pass@2", "maj@2"}
    assert metrics["examples"] == 3
    assert metrics["pass@1"] <= metrics["pass@2"] + 1e-12  # more tries never hurt
    assert printed["data"]["task"] == "arithmetic" and printed["data"]["split"] == "test"


def test_cli_eval_of_a_run_dir_uses_its_recipe(tiny_config, capsys) -> None:
    run_dir = train(
        tiny_config(data={"task": "arithmetic", "task_args": {"size": 64, "max_value": 9}})
    )
    capsys.readouterr()
    assert main(["eval", str(run_dir), "rollout.max_new_tokens=4", "--examples", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == str(run_dir / "final")
    assert printed["data"]["task_args"] == {"size": 64, "max_value": 9}


def test_cli_eval_bad_input_is_one_line(tiny_model_dir: Path, capsys) -> None:
    assert main(["eval", str(tiny_model_dir), "--task", "no-such-task"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown task 'no-such-task'" in err and "\n" not in err
    with pytest.raises(SystemExit):
        main(["eval", str(tiny_model_dir), "--samples", "0"])


def test_eval_judges_answers_like_the_recipes_accuracy_reward(tiny_config) -> None:
    spec = {"name": "accuracy", "args": {"extract": ["answer"], "last_number": True}}
    config = tiny_config(rewards={"functions": [spec]})
    assert extract_of(config) == ("answer", "last_number")
    assert extract_of(tiny_config()) == DEFAULT_EXTRACT  # built-in accuracy, default arguments
    # with last_number the final number counts; the default needs a tag
    assert is_correct("so 3 + 4 = 7.", "7", extract_of(config))
    assert not is_correct("so 3 + 4 = 7.", "7")
    # a tag wins over the last number when both are there
    assert not is_correct("<answer>8</answer> or 7", "7", extract_of(config))
    scored = score_samples([["3 + 4 = 7", "<answer>7</answer>"]], ["7"], extract_of(config))
    assert scored["pass@1"] == 1.0 and scored["maj@2"] == 1.0


def test_eval_without_math_verify_when_the_recipe_turns_it_off(tiny_config) -> None:
    """An arithmetic answer that restates the question is 53 to math-verify; a recipe that turns
    math-verify off (recipes/gemma-r1-zero.yaml) must see it judged wrong in eval too."""
    spec = {"name": "accuracy", "args": {"extract": ["answer"], "math_verify": False}}
    strict = settings_for(tiny_config(rewards={"functions": [spec]}), 2)
    assert not strict.symbolic and settings_for(tiny_config(), 2).symbolic
    restated = "<answer>23 + 30</answer>"
    assert is_correct(restated, "53", ("answer",))  # the default: symbolic equivalence
    assert not is_correct(restated, "53", strict.extract, strict.symbolic)
    assert is_correct("<answer>53</answer>", "53", strict.extract, strict.symbolic)
    # sampled: two restated, one right: strict, pass@1 = 1/3 and the majority answer is wrong
    samples = [[restated, restated, "<answer>53</answer>"]]
    assert score_samples(samples, ["53"], ("answer",))["maj@3"] == 1.0
    scored = score_samples(samples, ["53"], strict.extract, strict.symbolic)
    assert scored["pass@1"] == pytest.approx(1 / 3, abs=1e-12) and scored["maj@3"] == 0.0
