"""Rollout speed: the HF engine against vLLM (its CPU build) on SmolLM2, against the decode limit.

Both engines sample the default recipe's shape (P prompts x G completions, ``max_new_tokens``,
temperature 1) from the same float32 weights, alternated round by round in one process so that
the other jobs on the machine slow both alike. vLLM's time includes a weight push
(``sync_weights``) before each rollout, as in training. The decode limit is measured in the same
process at the same time: a decode step streams every weight once for the whole batch (memory
bandwidth) and does ``2 x params`` FLOPs per active row (matmul peak); tokens/s can be no more
than ``rows / max(bytes / bandwidth, flops / peak)``.

    .venv/bin/python -m benchmarks.speed.rollout_speed --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from benchmarks import common
from grpo.build import build_engine
from grpo.config import RolloutConfig, load_config
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.models import load_tokenizer, resolve_model_path
from grpo.rollout import render_prompt


def memory_bandwidth(gib: float = 0.5, seconds: float = 1.0) -> float:
    """Bytes/s read by a sum over a float32 buffer larger than the caches, best of repeats."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.numel() * 4 / (time.perf_counter() - t0))
    return best


def decode_limit(params: int, rows: int, bandwidth: float, peak: float) -> dict[str, float]:
    """Tokens/s bound for ``rows`` active rows: weights read once per step, 2 FLOPs per weight."""
    stream_s = params * 4 / bandwidth
    compute_s = 2 * params * rows / peak
    return {
        "stream_s": stream_s,
        "compute_s": compute_s,
        "tokens_per_s": rows / max(stream_s, compute_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/rollout_speed_smollm2.json")
    args = parser.parse_args()

    recipe = load_config()  # the default recipe
    rollout: RolloutConfig = recipe.rollout
    path = resolve_model_path(recipe.model.name)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = load_dataset_rows(recipe.data, recipe.train.seed)
    system = system_prompt_for(recipe.data)
    p, g = rollout.prompts_per_step, rollout.group_size
    engines = {
        "hf": build_engine("hf", model=model, tokenizer=tokenizer, config=rollout),
        "vllm": build_engine(
            "vllm",
            model=model,
            tokenizer=tokenizer,
            config=rollout.model_copy(update={"engine": "vllm"}),
        ),
    }
    params = sum(t.numel() for t in model.parameters())
    result: dict[str, Any] = {
        "shape": {"prompts": p, "group_size": g, "max_new_tokens": rollout.max_new_tokens},
        "rounds": [],
    }
    for r in range(args.rounds):
        batch = rows[r * p : (r + 1) * p]
        prompts = [render_prompt(tokenizer, row["prompt"], system) for row in batch]
        seeds = list(range(r * p, (r + 1) * p))
        entry: dict[str, Any] = {
            "matmul_peak_flops": common.matmul_peak_flops(),
            "bandwidth_bytes_per_s": memory_bandwidth(),
        }
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.sync_weights(model)
            t1 = time.perf_counter()
            out = engine.generate(prompts, batch, g, seeds=seeds)
            t2 = time.perf_counter()
            tokens = int(out.completion_mask.sum())
            entry[name] = {
                "push_s": t1 - t0,
                "generate_s": t2 - t1,
                "tokens": tokens,
                "tokens_per_s": tokens / (t2 - t1),
                "tokens_per_s_with_push": tokens / (t2 - t0),
            }
        entry["limit"] = decode_limit(
            params, p * g, entry["bandwidth_bytes_per_s"], entry["matmul_peak_flops"]
        )
        result["rounds"].append(entry)
        print(json.dumps(entry), flush=True)
    later = result["rounds"][1:] or result["rounds"]  # round 1 includes vLLM's warm-up
    summary = {
        name: common.median([e[name]["tokens_per_s_with_push"] for e in later]) for name in engines
    }
    summary["limit"] = common.median([e["limit"]["tokens_per_s"] for e in later])
    summary["vllm_over_hf"] = common.ratio(summary["vllm"], summary["hf"])
    result["median_tokens_per_s_after_round_1"] = summary
    print(json.dumps(summary))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
