"""How long ``rollout.compile``'s first rollout waits, with inductor's kernel cache empty and
with it filled by an earlier process.

A compilation happens once per process, so each measurement is a fresh process: the default
recipe's model and rollout shape, ``rollout.compile: true``, three rollouts, the first of which
holds the compilation. The processes share one kernel folder (``TORCHINDUCTOR_CACHE_DIR``, a
new temporary folder, so the user's own cache is neither read nor filled): the first starts with
it empty, the later ones find what the first wrote, as a second ``grpo train`` on the same
machine finds ``~/.cache/grpo/inductor``.

    .venv/bin/python -m benchmarks.speed.compile_start --warm 2 \
        --out benchmarks/results/compile_start_xeon_amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common


def one_process(precision: str, model: str | None) -> dict[str, Any]:
    """In this process: three compiled rollouts of the default recipe's shape (of ``model``,
    default the recipe's)."""
    from benchmarks.speed.rollout_speed import Variant, default_setup, round_prompts
    from grpo.build import build_engine

    setup = default_setup(model)
    config = setup.rollout.model_copy(update={"compile": True})
    engine = build_engine("hf", model=setup.model, tokenizer=setup.tokenizer, config=config)
    variant = Variant(engine, precision, precision == "bfloat16")
    seconds, tokens = [], []
    for r in range(3):
        batch, prompts, seeds = round_prompts(setup, r)
        out, s = variant.sample(setup.model, prompts, batch, setup.rollout.group_size, seeds=seeds)
        seconds.append(s)
        tokens.append(int(out.completion_mask.sum()))
    later = common.median(seconds[1:])
    return {
        "rollout_s": seconds,
        "tokens": tokens,
        "first_rollout_over_later_s": seconds[0] - later,
        "later_tokens_per_s": common.median(
            [t / s for t, s in zip(tokens[1:], seconds[1:], strict=True)]
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--warm", type=int, default=2, help="processes after the cold one")
    parser.add_argument("--model", help="a model name or alias (default: the recipe's)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.precision, args.model)))
        return
    result: dict[str, Any] = {
        "machine": common.machine(),
        "precision": args.precision,
        "model": args.model,
        "processes": [],
    }
    child = [sys.executable, "-m", "benchmarks.speed.compile_start", "--child"]
    with tempfile.TemporaryDirectory(prefix="grpo-kernels-") as folder:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": folder}
        for i in range(1 + args.warm):
            kernel_files = sum(1 for f in Path(folder).rglob("*") if f.is_file())
            start = time.perf_counter()
            model = ["--model", args.model] if args.model else []
            done = subprocess.run(
                [*child, "--precision", args.precision, *model],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            entry = {
                "kernel_cache": "empty" if i == 0 else "filled",
                # the files the process found: a later one must find what the first wrote
                "kernel_files_before": kernel_files,
                "process_s": time.perf_counter() - start,
                **json.loads(done.stdout.strip().splitlines()[-1]),
            }
            result["processes"].append(entry)
            print(json.dumps(entry), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
