"""The update's log-prob pass (forward + backward) on one real rollout, cut into micro-batches of
several sizes and token budgets, timed alternately.

    .venv/bin/python -m benchmarks.speed.micro_batch --setup smollm2 --repeats 2

One rollout of the set-up is the workload, so every variant trains on identical completions.
Each variant runs the forward and backward of every micro-batch (no optimizer step, so the weights
stay put); variants alternate A B C ... A B C in this process. ``sliced/<size>`` is the log-prob
path before the fix (a slice of the logits per 64-position chunk: each slice's backward writes a
gradient the size of the whole micro-batch's logits, so its cost grew with the square of the
micro-batch), kept here as the plain path to compare against.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import grpo.scoring.logprobs
from benchmarks import common
from benchmarks.speed.levers import alternate
from grpo.config import DataConfig, RolloutConfig
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.models import load_tokenizer, resolve_model_path
from grpo.rollout import render_prompt
from grpo.rollout.hf import HFEngine
from grpo.scoring.logprobs import completion_logprobs
from grpo.training.micro_batches import micro_batches

RESULTS = Path(__file__).resolve().parents[1] / "results"


def sliced_token_logprobs(
    logits: torch.Tensor,
    at: torch.Tensor,
    targets: torch.Tensor,
    decoding: float = 1.0,
    with_entropy: bool = False,
    chunk: int = 64,
    history: Any = None,
) -> tuple[torch.Tensor, None]:
    """``logprobs.token_logprobs`` as it was (temperature 1 only): one slice per chunk."""
    lse = []
    for start in range(0, logits.shape[0], chunk):
        lse.append(torch.logsumexp(logits[start : start + chunk].float(), dim=-1))
    picked = logits[at, targets].float()
    return picked - torch.cat(lse)[at], None


@contextmanager
def sliced() -> Iterator[None]:
    original = grpo.scoring.logprobs.token_logprobs
    grpo.scoring.logprobs.token_logprobs = sliced_token_logprobs
    try:
        yield
    finally:
        grpo.scoring.logprobs.token_logprobs = original


def update_pass(model, batches, old_path: bool) -> Callable[[], None]:
    def go() -> None:
        with sliced() if old_path else nullcontext():
            for mb in batches:
                logp, _ = completion_logprobs(
                    model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask
                )
                (logp * mb.completion_mask).sum().backward()
        model.zero_grad(set_to_none=True)

    return go


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="tiny")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    setup = common.SETUPS[args.setup]
    torch.manual_seed(0)
    path = resolve_model_path(setup["model"])
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = RolloutConfig(
        prompts_per_step=setup["prompts_per_step"],
        group_size=setup["group_size"],
        max_new_tokens=setup["max_new_tokens"],
    )
    data = DataConfig(**setup["data"])
    rows = load_dataset_rows(data, 0)[: config.prompts_per_step]
    prompts = [render_prompt(tokenizer, r["prompt"], system_prompt_for(data)) for r in rows]
    rollout = HFEngine(model, tokenizer, config).generate(prompts, rows, config.group_size)
    model.train()
    zeros = torch.zeros(rollout.num_completions)
    variants: dict[str, Callable[[], None]] = {}
    cuts: dict[str, list[int]] = {}
    for size in args.sizes:
        batches = micro_batches(rollout, zeros, size)
        variants[f"rows/{size}"] = update_pass(model, batches, old_path=False)
        cuts[f"rows/{size}"] = [len(mb.index) for mb in batches]
    for budget in args.tokens:
        batches = micro_batches(rollout, zeros, rollout.num_completions, budget)
        variants[f"tokens/{budget}"] = update_pass(model, batches, old_path=False)
        cuts[f"tokens/{budget}"] = [len(mb.index) for mb in batches]
    for size in (min(args.sizes), max(args.sizes)):
        variants[f"sliced/{size}"] = update_pass(
            model, micro_batches(rollout, zeros, size), old_path=True
        )
    timed = alternate(variants, args.repeats)
    first = timed["median_s"][f"rows/{min(args.sizes)}"]
    result: dict[str, Any] = {
        "setup": args.setup,
        "completions": rollout.num_completions,
        "completion_tokens": int(rollout.completion_mask.sum()),
        "threads": torch.get_num_threads(),
        "rows_per_micro_batch": cuts,
        "median_s": timed["median_s"],
        "ratio_to_smallest": {k: common.ratio(v, first) for k, v in timed["median_s"].items()},
        "times_s": timed["times_s"],
    }
    out = args.out or RESULTS / f"micro_batch_{args.setup}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "times_s"}, indent=1))


if __name__ == "__main__":
    main()
