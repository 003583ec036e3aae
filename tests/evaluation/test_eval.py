"""pass@k / maj@k arithmetic, the evaluation pipeline with a scripted model, the trainer's
eval hook, and `grpo eval`."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo import build
from grpo.cli import main
from grpo.config import RewardsConfig, RewardSpec, RolloutConfig, build_config
from grpo.data import DataError, verifier_of
from grpo.data.prompts import PromptFormat
from grpo.eval import (
    EvalSettings,
    answer_strategies,
    evaluate,
    generate,
    k_values,
    majority_answer,
    pass_at_k,
    score_samples,
)
from grpo.models import load_tokenizer
from grpo.rewards import RewardRunner
from grpo.rewards.accuracy import extract_answer
from grpo.rollout import grouped_rollout
from grpo.rollout.hf import HFEngine
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
    correct = [
        # gold 5: one correct of three; the majority (4, twice) is wrong
        [False, True, False],
        # gold 9: two correct of three, one without an answer; majority 9 is right
        [True, False, True],
    ]
    answers = [["4", "5", "4"], ["9", None, " 9 "]]
    out = score_samples(correct, answers)
    # pass@1 = mean(c/n) = (1/3 + 2/3) / 2 = 0.5
    assert out["pass@1"] == pytest.approx(0.5, abs=1e-12)
    # pass@2: problem 1: 1 - C(2,2)/C(3,2) = 2/3; problem 2: n-c = 1 < 2 -> 1; mean 5/6
    assert out["pass@2"] == pytest.approx(5 / 6, abs=1e-12)
    assert out["pass@3"] == pytest.approx(1.0, abs=1e-12)
    assert out["maj@3"] == pytest.approx(0.5, abs=1e-12)
    # the majority's first sample decides: "4" first came from a wrong one
    assert score_samples([[True, False, False]], [["5", "4", "4"]])["maj@3"] == 0.0


# ------------------------------------------------------------------------- scripted model

PROBLEM_RE = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


class ScriptedEngine:
    """A rollout engine that answers "What is a op b?" prompts with a fixed policy.

    Greedy: right answers for problems whose first operand a is even, wrong ones otherwise.
    Sampled: the i-th of the k samples answers right when i < a mod 4 (so c = min(a mod 4, k));
    every wrong sample gives the same wrong answer, so a wrong majority is possible.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[int, int, bool]] = []  # (prompts, group size, greedy) per call

    def sync_weights(self, model: nn.Module) -> None:
        pass

    def _answer(self, prompt: str, right: bool) -> str:
        a, op, b = PROBLEM_RE.findall(prompt)[-1]
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        return f"<think>x</think><answer>{value if right else value + 1}</answer>"

    def generate(self, prompts, rows, group_size, seeds=None, temperature=None, greedy=False):
        self.calls.append((len(prompts), group_size, greedy))
        tok = self.tokenizer
        ids = []
        for prompt in prompts:
            a = int(PROBLEM_RE.findall(prompt)[-1][0])
            for i in range(group_size):
                right = (a % 2 == 0) if greedy else (i < a % 4)
                text = self._answer(prompt, right)
                ids.append([*tok(text, add_special_tokens=False).input_ids, tok.eos_token_id])
        width = max(len(x) for x in ids)
        completion = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        mask = torch.tensor([[k < len(x) for k in range(width)] for x in ids])
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
        truncated = torch.zeros(len(ids), dtype=torch.bool)
        return grouped_rollout(
            tok,
            enc.input_ids,
            enc.attention_mask,
            completion,
            mask,
            truncated,
            prompts,
            rows,
            group_size,
        )


def exact_verifier() -> RewardRunner:
    return RewardRunner(RewardsConfig(functions=[RewardSpec(**verifier_of(build_config({}).data))]))


def test_evaluate_with_a_scripted_engine(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    engine = ScriptedEngine(tokenizer)
    rows = [  # a: greedy right when even; c = right samples of 3 = min(a mod 4, 3)
        {"prompt": "What is 2 + 3?", "answer": "5"},  # greedy right, c = 2
        {"prompt": "What is 7 - 1?", "answer": "6"},  # greedy wrong, c = 3
        {"prompt": "What is 4 * 4?", "answer": "16"},  # greedy right, c = 0
        {"prompt": "What is 5 + 5?", "answer": "10"},  # greedy wrong, c = 1
    ]
    settings = EvalSettings(samples=3, batch_size=3)
    verifier = exact_verifier()
    try:
        out = evaluate(engine, tokenizer, rows, PromptFormat(system="sys"), verifier, settings)
    finally:
        verifier.close()
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
    # batch_size completions per call: greedy 3 + 1 prompts, sampled 1 prompt x 3 at a time
    assert engine.calls == [(3, 1, True), (1, 1, True), *[(1, 3, False)] * 4]


def test_evaluate_judges_with_the_recipes_rewards(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    engine = ScriptedEngine(tokenizer)
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
    settings = EvalSettings(reward_threshold=1.5)
    verifier = exact_verifier()
    bare = [{"prompt": r["prompt"]} for r in rows]
    try:
        out = evaluate(engine, tokenizer, rows, PromptFormat(), verifier, settings, rewards)
        # totals: right answers 1 + 0.5 (format) = 1.5, the wrong one 0 + 0.5
        assert out["reward/mean"] == pytest.approx((1.5 + 0.5 + 1.5) / 3, abs=1e-6)
        assert out["reward/pass_rate"] == pytest.approx(2 / 3, abs=1e-6)  # totals >= 1.5
        assert out["reward/accuracy/mean"] == pytest.approx(2 / 3, abs=1e-6)
        assert out["reward/format/mean"] == 1.0
        # rows without gold answers: judged by the rewards alone (accuracy's None is left out)
        out = evaluate(engine, tokenizer, bare, PromptFormat(), verifier, settings, rewards)
        assert "accuracy" not in out and math.isnan(out["reward/accuracy/mean"])
        assert out["reward/mean"] == 0.5 and out["reward/pass_rate"] == 0.0
        with pytest.raises(DataError, match="answer"):
            evaluate(engine, tokenizer, bare, PromptFormat(), verifier, settings)
    finally:
        rewards.close()
        verifier.close()


def test_eval_generates_with_the_engines_controls(tiny_model_dir: Path) -> None:
    """Eval's completions come from the rollout engine under the recipe's controls: they end
    where training's would (``rollout.stop``), and the policy's mode is restored."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    prompt = PromptFormat().render(tokenizer, {"prompt": "What is 2 + 3?"})
    settings = EvalSettings()

    def sampled(**rollout) -> str:
        engine = HFEngine(model, tokenizer, RolloutConfig(max_new_tokens=24, **rollout))
        # sampled (the random model's greedy choice is EOS); the same seed draws the same tokens
        return generate(engine, [prompt], [{}], 1, False, settings).completions[0]

    free = sampled()
    stop = free[len(free) // 2]
    stopped = sampled(stop=[stop])
    assert stopped == free[: free.index(stop) + 1] and len(stopped) < len(free)
    assert sampled() == free  # seeded by train.seed and the row: the same samples every time
    assert sampled(top_k=1) != free  # a generation control of the recipe applies
    assert model.training  # the engine's session restores the training mode
    # grpo eval and the trainer's held-out eval use the recipe's engine and its stop strings
    config = build_config({"rollout": {"stop": ["</answer>"]}})
    assert build.engine_of(config, model, tokenizer).config.stop == ["</answer>"]


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
    # the default recipe's verifier: its accuracy reward's spec
    verifier = printed["verifier"]
    assert verifier["name"] == "accuracy" and verifier["args"]["last_number"] is True


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


def judged(config, texts: list[str], gold: str) -> list[bool]:
    """The verifier of ``config`` on completions of one row with gold answer ``gold``."""
    verifier = build.verifier_runner(config)
    try:
        out = verifier(
            texts, ["q"] * len(texts), {"answer": [gold] * len(texts)}, [[1]] * len(texts)
        )
    finally:
        verifier.close()
    return (out.per_function[:, 0] >= 1).tolist()


def test_eval_judges_with_the_tasks_verifier_or_the_recipes(tiny_config) -> None:
    # the arithmetic task's verifier: exact numbers inside the default extraction
    assert judged(
        tiny_config(), ["<answer>7</answer>", "so 3 + 4 = 7.", "<answer>8</answer>"], "7"
    ) == [True, False, False]
    # a recipe's own verifier: with last_number the final number counts
    spec = {"name": "accuracy", "args": {"extract": ["answer"], "last_number": True}}
    config = tiny_config(data={"verifier": spec})
    assert judged(config, ["so 3 + 4 = 7.", "<answer>8</answer> or 7"], "7") == [True, False]
    # the recipe's rewards do not decide what eval counts as correct
    lenient = tiny_config(rewards={"functions": [spec]})
    assert judged(lenient, ["so 3 + 4 = 7."], "7") == [False]


def test_eval_without_math_verify_for_numeric_tasks(tiny_config) -> None:
    """An arithmetic answer that restates the question is 53 to math-verify; the numeric tasks'
    verifier judges it wrong, math500's (LaTeX answers) takes math-verify's equivalence."""
    restated = "<answer>23 + 30</answer>"
    assert judged(tiny_config(), [restated, "<answer>53</answer>"], "53") == [False, True]
    symbolic = tiny_config(data={"task": "math500"})
    assert judged(symbolic, [restated], "53") == [True]
    # sampled: two restated, one right: pass@1 = 1/3 and the majority answer is wrong
    correct = judged(tiny_config(), [restated, restated, "<answer>53</answer>"], "53")
    scored = score_samples([correct], [["23 + 30", "23 + 30", "53"]])
    assert scored["pass@1"] == pytest.approx(1 / 3, abs=1e-12) and scored["maj@3"] == 0.0


def test_a_bad_verifier_fails_before_the_model_loads(tiny_config, monkeypatch) -> None:
    from grpo.config import ConfigError
    from grpo.eval import evaluate_config
    from grpo.rewards import RewardError

    loaded = []
    monkeypatch.setattr(build, "build_for_sampling", lambda *a: loaded.append(1))
    config = tiny_config(data={"verifier": {"name": "no-such-reward"}})
    with pytest.raises((RewardError, ConfigError), match="unknown reward 'no-such-reward'"):
        evaluate_config(config, samples=1, examples=2)
    assert loaded == []


def test_maj_votes_with_the_verifiers_own_extraction(tiny_config) -> None:
    # a last_number verifier: "so it is 7." answers 7; with the default extraction it would
    # cast no vote and the wrong 8s would win
    spec = {"name": "accuracy", "args": {"extract": ["answer"], "last_number": True}}
    verifier = build.verifier_runner(tiny_config(data={"verifier": spec}))
    code = build.verifier_runner(tiny_config(data={"task": "humaneval"}))
    try:
        strategies = answer_strategies(verifier)
        texts = ["so it is 7.", "<answer>8</answer>", "so it is 7.", "<answer>8</answer>"]
        answers = [[extract_answer(t, strategies) for t in texts]]
        assert answers == [["7", "8", "7", "8"]]
        assert score_samples([[True, False, True, False]], answers)["maj@4"] == 1.0
        assert answer_strategies(code) is None  # unit tests read no answer: no maj@k
        assert "maj@2" not in score_samples([[True, False]], None)
    finally:
        verifier.close()
        code.close()


def test_a_verifier_that_fails_is_counted_not_hidden(tiny_model_dir: Path, tmp_path: Path) -> None:
    # a user verifier that raises on every completion: judged wrong, and eval says how often
    broken = tmp_path / "broken.py"
    broken.write_text("def verify(completions, **columns):\n    raise RuntimeError('boom')\n")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": "What is 4 * 4?", "answer": "16"},
    ]
    verifier = RewardRunner(
        RewardsConfig(functions=[RewardSpec(name=f"{broken}:verify")], workers=1)
    )
    try:
        out = evaluate(ScriptedEngine(tokenizer), tokenizer, rows, PromptFormat(), verifier)
    finally:
        verifier.close()
    assert out["accuracy"] == 0.0 and out["verifier_errors"] == 2.0
