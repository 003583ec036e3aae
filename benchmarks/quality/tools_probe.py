"""Which prompt makes SmolLM2-135M-Instruct call the Python tool and answer with its output, before
any training (issue 15, point 5). The multiplication task's test problems, through the trainer's
own prompt format and multi-turn loop (HF engine, fenced calls, 64 tokens for all turns): greedy
on ``--problems`` problems, and 4 samples at ``--temperature`` (1) on each.

Per variant and mode: the share of completions that ran a call, that wrote an <answer> tag, whose
answer equals the last tool output, and that are correct. Prints and writes ``--out``
(benchmarks/results/tools_probe.json).

    python -m benchmarks.quality.tools_probe [variant ...] [--problems 16] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from grpo.config import ModelConfig, RolloutConfig
from grpo.data.prompts import PromptFormat
from grpo.data.tasks import MULTIPLICATION_SYSTEM, multiplication_rows
from grpo.models import load_policy, load_tokenizer, resolve_model_path
from grpo.rollout.hf import HFEngine
from grpo.rollout.turns import MultiTurnEngine, TurnRequest

RESULTS = Path(__file__).resolve().parents[1] / "results" / "tools_probe.json"
TOOL_SYSTEM = (
    "Use Python to compute: write one ```python block that prints the result, and you will see "
    "its output. Then write the final answer as a number inside <answer></answer> tags."
)
INLINE = (
    "Use Python to compute. Write one ```python block that prints the result, then stop: you will "
    "see its output. Then write the final answer as a number inside <answer></answer> tags. "
    "Example: What is 12 * 34?\n```python\nprint(12 * 34)\n```\n(you see 408)\n<answer>408</answer>"
)


def exchange(a: int, b: int) -> list[dict[str, str]]:
    """One worked call as chat turns: the question, the call, the tool's output, the answer."""
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": f"```python\nprint({a} * {b})\n```\n"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"<answer>{a * b}</answer>"},
    ]


def direct(a: int, b: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": f"<answer>{a * b}</answer>"},
    ]


# name -> (system prompt, few-shot turns, tools on)
VARIANTS: dict[str, tuple[str, list[dict[str, str]], bool]] = {
    "inline": (INLINE, [], True),  # recipes/tools.yaml before few-shot turns
    "shot1": (TOOL_SYSTEM, exchange(12, 34), True),
    "shot2": (TOOL_SYSTEM, exchange(12, 34) + exchange(215, 307), True),
    "shot1-bare": ("", exchange(12, 34), True),
    "none-shot1": (MULTIPLICATION_SYSTEM, direct(12, 34), False),
}

ANSWER_RE = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def judge(turns: list[dict[str, Any]], answer_text: str, gold: str) -> dict[str, bool]:
    found = ANSWER_RE.findall(answer_text)
    answer = found[-1].replace(",", "") if found else None
    outputs = [t["output"].strip() for t in turns if t.get("output")]
    return {
        "called": any(t.get("time_s") is not None for t in turns),
        "tagged": answer is not None,
        "echoes_output": answer is not None and bool(outputs) and answer == outputs[-1],
        "correct": answer == gold,
    }


def probe(
    model, tokenizer, name: str, rows: list[dict[str, Any]], temperature: float
) -> dict[str, Any]:
    system, few_shot, tools = VARIANTS[name]
    config = RolloutConfig(
        tools=["python"] if tools else [],
        max_turns=2,
        max_new_tokens=64,
        group_size=4,
        temperature=temperature,
    )
    fmt = PromptFormat(system=system or None)
    prompts = [
        fmt.render(tokenizer, {"prompt": [*few_shot, {"role": "user", "content": r["prompt"]}]})
        for r in rows
    ]
    out: dict[str, Any] = {"system": system, "few_shot": few_shot, "tools": tools}
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    for mode, greedy, n in (("greedy", True, 1), ("sampled", False, 4)):
        seeds = list(range(len(prompts)))
        if tools:
            engine = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config, greedy)
            rollout = engine.generate(prompts, rows, n, seeds=seeds)
            trajectories = list(zip(rollout.turns, rollout.answers, strict=True))
        else:  # one plain turn, as a run without tools generates
            requests = [
                TurnRequest(ids, n, s, 64) for ids, s in zip(prompt_ids, seeds, strict=True)
            ]
            groups = HFEngine(model, tokenizer, config).generate_turns(requests, [], greedy)
            texts = [
                tokenizer.decode(t.token_ids, skip_special_tokens=True) for g in groups for t in g
            ]
            trajectories = [([{"text": t, "output": None, "time_s": None}], t) for t in texts]
        marks = [
            judge(turns, answer, rows[i // n]["answer"])
            for i, (turns, answer) in enumerate(trajectories)
        ]
        out[mode] = {k: sum(m[k] for m in marks) / len(marks) for k in marks[0]}
        out[mode]["completions"] = len(marks)
        out[mode]["examples"] = [
            {"turns": [t["text"] for t in trajectories[i][0]], "gold": rows[i // n]["answer"]}
            for i in range(0, len(marks), max(1, len(marks) // 4))
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"any of {', '.join(VARIANTS)} (default all)")
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled mode")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.variants = args.variants or list(VARIANTS)
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    torch.set_num_threads(2)
    path = resolve_model_path(args.model)
    model = load_policy(ModelConfig(name=path), path).eval()
    tokenizer = load_tokenizer(path)
    rows = multiplication_rows("test", seed=0, size=400)[: args.problems]
    report: dict[str, Any] = {
        "command": "python -m benchmarks.quality.tools_probe " + " ".join(sys.argv[1:]),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "problems": args.problems,
        "temperature": args.temperature,
    }
    for name in args.variants:
        t0 = time.perf_counter()
        report[name] = probe(model, tokenizer, name, rows, args.temperature)
        report[name]["time_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps({k: report[name][k] for k in ("greedy", "sampled")}), flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
