"""Which reasoning-gym task can Gemma 3 270M (base) sometimes solve? What ``grpo eval --samples 8``
measures, with recipes/r1-zero-sums.yaml's template and temperature, on candidate generators at their
easiest settings (their curriculum's level 0), each judged twice on the same completions:
strictly (the answer inside ``<answer>``, as the reward pays) and leniently
(``last_number: true``). The model loads once and each generator's completions are sampled once
(``grpo.eval``'s functions), so both judges see the same samples. Results merge into
benchmarks/results/r1_zero_tasks.json, so a run can be continued (docs/results/r1-zero-tasks.md).
Run: python -m benchmarks.quality.r1_zero_tasks [generator ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from grpo import build
from grpo.config import RewardsConfig, load_config
from grpo.data import heldout_rows
from grpo.data.reasoning_gym import level_config
from grpo.eval import EvalSettings, answer_strategies, generate, score_samples, verdicts
from grpo.rewards import RewardRunner
from grpo.rewards.accuracy import extract_answer
from grpo.rewards.inputs import reward_inputs

CANDIDATES = [
    "chain_sum",
    "basic_arithmetic",
    "products",
    "leg_counting",
    "power_function",
    "count_bits",
    "letter_counting",
    "gcd",
    "simple_equations",
    "number_sequence",
    "decimal_chain_sum",
    "spell_backward",
]
EXAMPLES, SAMPLES = 12, 8
OUT = Path(__file__).parents[1] / "results" / "r1_zero_tasks.json"
JUDGES = {"strict": {}, "lenient": {"last_number": True}}


def config_for(name: str):
    task_args = {"name": name, "config": level_config(name, {}, 0, None), "size": EXAMPLES}
    return load_config(
        "recipes/r1-zero-sums.yaml",
        ["data.task=reasoning_gym", f"data.task_args={json.dumps(task_args)}"],
    )


def main() -> None:
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    todo = [n for n in sys.argv[1:] or CANDIDATES if f"{n}/lenient" not in results]
    if not todo:
        return
    parts = build.build_for_sampling(config_for(todo[0]), [])
    parts.rewards.close()
    engine = build.engine_of(config_for(todo[0]), parts.policy, parts.tokenizer)
    judges = {
        judge: RewardRunner(RewardsConfig(functions=[{"name": "reasoning_gym", "args": args}]))
        for judge, args in JUDGES.items()
    }
    try:
        for name in todo:
            t0 = time.perf_counter()
            config = config_for(name)
            rows = heldout_rows(config.data, config.train.seed, EXAMPLES)
            settings = EvalSettings(samples=SAMPLES, seed=config.train.seed)
            prompts = [parts.prompt_format.render(parts.tokenizer, r) for r in rows]
            with torch.inference_mode():
                greedy = generate(engine, prompts, rows, 1, True, settings)
                sampled = generate(engine, prompts, rows, SAMPLES, False, settings)
            texts = reward_inputs(sampled)[0]
            answered = sum(extract_answer(t, ("answer",)) is not None for t in texts) / len(texts)
            for judge, runner in judges.items():
                correct, failed = verdicts(runner, sampled)
                groups = [correct[i : i + SAMPLES] for i in range(0, len(correct), SAMPLES)]
                greedy_right, _ = verdicts(runner, greedy)
                given = [extract_answer(t, answer_strategies(runner)) for t in texts]
                answers = [given[i : i + SAMPLES] for i in range(0, len(given), SAMPLES)]
                results[f"{name}/{judge}"] = {
                    **score_samples(groups, answers),
                    "greedy_accuracy": sum(greedy_right) / len(rows),
                    "sampled_answer_rate": answered,
                    "verifier_errors": failed,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "example": texts[0][:300],
                }
                print(
                    name,
                    judge,
                    {k: v for k, v in results[f"{name}/{judge}"].items() if k != "example"},
                    flush=True,
                )
            OUT.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    finally:
        for runner in judges.values():
            runner.close()


if __name__ == "__main__":
    main()
