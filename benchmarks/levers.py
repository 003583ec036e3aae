"""Each speed lever on its own: the fast path against the plain one, timed alternately.

    .venv/bin/python -m benchmarks.levers --setup smollm2 --repeats 3

One real rollout of the set-up (P prompts x G completions from the model) is the workload.
Variants of one lever run A B A B ... in this process, so a machine shared with other jobs
slows both alike; the JSON has every timing, the medians and their ratio (fast / plain).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

from benchmarks import common
from grpo.config import RolloutConfig
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.logprobs import full_sequence_logprobs, shared_prompt_logprobs
from grpo.models import load_tokenizer, resolve_model_path
from grpo.rollout import render_prompt
from grpo.rollout.hf import HFEngine, SeededGroupSampler, sample_groups
from grpo.trainer import micro_batches

RESULTS = Path(__file__).parent / "results"


def alternate(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Any]:
    """Run the variants in turn ``repeats`` times; medians and the ratio of the last to the first."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    medians = {name: common.median(ts) for name, ts in times.items()}
    names = list(variants)
    return {
        "times_s": times,
        "median_s": medians,
        "ratio": common.ratio(medians[names[-1]], medians[names[0]]),
    }


def rollout_levers(model, tokenizer, enc, engine: HFEngine, g: int, repeats: int) -> dict:
    """generate() on P*G copies of the prompts against one prefill per prompt (same sampler)."""
    seeds = list(range(enc.input_ids.shape[0]))
    t = engine.config.max_new_tokens

    def processors() -> LogitsProcessorList:
        return LogitsProcessorList([*engine.warpers, SeededGroupSampler(seeds, g, model.device)])

    @torch.no_grad()
    def plain() -> None:
        model.generate(
            input_ids=enc.input_ids.repeat_interleave(g, dim=0),
            attention_mask=enc.attention_mask.repeat_interleave(g, dim=0),
            generation_config=GenerationConfig(
                do_sample=False,
                max_new_tokens=t,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=engine.eos,
            ),
            logits_processor=processors(),
        )

    def shared(mode: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with mode():
                sample_groups(
                    model,
                    enc.input_ids,
                    enc.attention_mask,
                    g,
                    processors(),
                    t,
                    engine.eos,
                    tokenizer.pad_token_id,
                )

        return run

    return {
        "prefill_once": alternate(
            {"generate": plain, "prefill_once": shared(torch.no_grad)}, repeats
        ),
        "inference_mode": alternate(
            {"no_grad": shared(torch.no_grad), "inference_mode": shared(torch.inference_mode)},
            repeats,
        ),
    }


def logprob_levers(model, rollout, micro_batch_size: int, repeats: int) -> dict:
    """Forward (+ backward) over the step's micro-batches: full sequences vs shared prompts,
    length-sorted vs group-ordered micro-batches."""
    zeros = torch.zeros(rollout.num_completions)
    sorted_batches = micro_batches(rollout, zeros, micro_batch_size)
    # whole groups per micro-batch (needs a size that is a multiple of G), trimmed alike
    g = rollout.group_size
    k = max(micro_batch_size // g, 1)
    p = rollout.num_completions // g
    grouped = [
        micro_batches(rollout.select_groups(list(range(i, min(i + k, p)))), zeros, k * g)[0]
        for i in range(0, p, k)
    ]

    def run(shared: bool, grad: bool, batches) -> Callable[[], None]:
        def go() -> None:
            for mb in batches:
                with torch.set_grad_enabled(grad):
                    if shared:
                        key = torch.cat([mb.prompt_ids, mb.prompt_mask.long()], dim=1)
                        unique, inverse = torch.unique(key, dim=0, return_inverse=True)
                        s = mb.prompt_ids.shape[1]
                        logp, _ = shared_prompt_logprobs(
                            model,
                            unique[:, :s],
                            unique[:, s:].bool(),
                            inverse,
                            mb.completion_ids,
                            mb.completion_mask,
                        )
                    else:
                        logp, _ = full_sequence_logprobs(
                            model,
                            mb.prompt_ids,
                            mb.prompt_mask,
                            mb.completion_ids,
                            mb.completion_mask,
                        )
                    if grad:
                        (logp * mb.completion_mask).sum().backward()
            model.zero_grad(set_to_none=True)

        return go

    model.train()
    return {
        "reference_forward_shared_prompt": alternate(
            {"full": run(False, False, sorted_batches), "shared": run(True, False, sorted_batches)},
            repeats,
        ),
        "update_shared_prompt": alternate(
            {"full": run(False, True, sorted_batches), "shared": run(True, True, sorted_batches)},
            repeats,
        ),
        "update_group_ordered_micro_batches": alternate(
            {"sorted": run(True, True, sorted_batches), "grouped": run(True, True, grouped)},
            repeats,
        ),
        "distinct_prompts_per_micro_batch": [
            len(torch.unique(mb.prompt_ids, dim=0)) for mb in sorted_batches
        ],
        "padded_tokens": {
            "sorted": sum(mb.completion_mask.numel() for mb in sorted_batches),
            "grouped": sum(mb.completion_mask.numel() for mb in grouped),
            "real": int(rollout.completion_mask.sum()),
        },
    }


def threads_lever(fn: Callable[[], Any], repeats: int) -> dict:
    """The same work with 1 thread and with torch's default."""
    default = torch.get_num_threads()

    def with_threads(n: int) -> Callable[[], None]:
        def go() -> None:
            torch.set_num_threads(n)
            try:
                fn()
            finally:
                torch.set_num_threads(default)

        return go

    return alternate(
        {f"threads={default}": with_threads(default), "threads=1": with_threads(1)}, repeats
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
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
    from grpo.config import DataConfig

    data = DataConfig(task="arithmetic")
    rows = load_dataset_rows(data, 0)[: config.prompts_per_step]
    prompts = [render_prompt(tokenizer, r["prompt"], system_prompt_for(data)) for r in rows]
    engine = HFEngine(model, tokenizer, config)
    rollout = engine.generate(prompts, rows, config.group_size)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    g = config.group_size
    result: dict[str, Any] = {
        "setup": args.setup,
        "prompt_tokens": int(enc.attention_mask.sum()) // config.prompts_per_step,
        "completion_tokens_mean": float(rollout.completion_mask.sum(dim=1).float().mean()),
        "threads": torch.get_num_threads(),
    }
    result.update(rollout_levers(model, tokenizer, enc, engine, g, args.repeats))
    result.update(logprob_levers(model, rollout, setup["micro_batch_size"], args.repeats))
    result["threads_update"] = threads_lever(
        lambda: logprob_levers(model, rollout, setup["micro_batch_size"], 1), args.repeats
    )
    out = args.out or RESULTS / f"levers_{args.setup}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for key, value in result.items():
        if isinstance(value, dict) and "ratio" in value:
            print(f"{key:36s} {value['median_s']}  ratio {value['ratio']:.2f}")
        else:
            print(f"{key:36s} {value}")


if __name__ == "__main__":
    main()
