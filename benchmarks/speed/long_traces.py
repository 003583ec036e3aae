"""Memory and time of scoring long completions: packed groups, one padded row per completion,
and the cost rule that ``completion_logprobs`` applies (packed while it pays, else one unmasked
row per completion).

    .venv/bin/python -m benchmarks.speed.long_traces                       # all sizes, ~15 min idle
    .venv/bin/python -m benchmarks.speed.long_traces --lengths 256 --groups 8

Workload per size: the tiny random model (2 layers, hidden 64), one group of G completions of a
64-token prompt, completion lengths spread evenly from T/2 to T (so padding is realistic), scored
twice as a step does with beta > 0: a reference forward without gradients, then the update's
forward and backward. Each (size, path) runs in its own process, so its peak RSS (above the
process's RSS before scoring) is its own. A packed group whose dense mask alone would pass
``--max-mask-gb`` is not run; its mask size is reported instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

RESULTS = Path(__file__).resolve().parents[1] / "results"
PROMPT_LEN = 64
PATHS = ("packed", "padded_rows", "rule")


def workload(group_size: int, length: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """One group: [G, 64] prompt (no padding), [G, T] completions of lengths T/2 .. T."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab, (PROMPT_LEN,), generator=gen)
    lengths = torch.linspace(length // 2, length, group_size).long()
    completion_ids = torch.randint(10, vocab, (group_size, length), generator=gen)
    completion_mask = torch.arange(length)[None, :] < lengths[:, None]
    prompt_ids = prompt.expand(group_size, -1).clone()
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def mask_gb(group_size: int, length: int) -> float:
    """A packed group's [L, L] mask: a bool, then the float copy the attention kernel makes."""
    lengths = torch.linspace(length // 2, length, group_size).long()
    positions = PROMPT_LEN + int((lengths - 1).sum())
    return positions * positions * 5 / 2**30


def measure(path: str, group_size: int, length: int, model_dir: str) -> dict[str, Any]:
    """Reference forward + update forward/backward on one path; runs in a worker process."""
    from transformers import AutoModelForCausalLM

    from grpo.scoring import logprobs, packing

    scorers = {
        "packed": packing.packed_logprobs,
        "padded_rows": logprobs.full_sequence_logprobs,
        "rule": logprobs.completion_logprobs,
    }
    from grpo.scoring.prefix_attention import use_prefix_attention

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if path == "rule":
        use_prefix_attention(model)  # the trainer's model, so "rule" is what the trainer does
    model.train()
    batch = workload(group_size, length, model.config.vocab_size)
    score = scorers[path]
    base = common.peak_rss_mb()
    t0 = time.perf_counter()
    with torch.no_grad():
        score(model, *batch)
    t1 = time.perf_counter()
    logp, _ = score(model, *batch)
    (logp * batch[3]).sum().backward()
    t2 = time.perf_counter()
    return {
        "reference_s": t1 - t0,
        "update_s": t2 - t1,
        "total_s": t2 - t0,
        "peak_mb": common.peak_rss_mb() - base,
    }


def run_worker(path: str, group_size: int, length: int, model_dir: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "benchmarks.speed.long_traces", "--worker", path]
        cmd += ["--groups", str(group_size), "--lengths", str(length)]
        cmd += ["--model-dir", model_dir, "--out", out.name]
        subprocess.run(cmd, check=True)
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--max-mask-gb", type=float, default=2.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = measure(args.worker, args.groups[0], args.lengths[0], args.model_dir)
        args.out.write_text(json.dumps(result))
        return
    from grpo.models import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "tiny"))
        for length in args.lengths:
            for group_size in args.groups:
                row: dict[str, Any] = {"length": length, "group_size": group_size}
                row["packed_mask_gb"] = mask_gb(group_size, length)
                for path in PATHS:
                    if path == "packed" and row["packed_mask_gb"] > args.max_mask_gb:
                        row[path] = None  # would not fit next to other jobs on this machine
                        continue
                    row[path] = run_worker(path, group_size, length, model_dir)
                measured = [row[p] for p in ("packed", "padded_rows") if row[p] is not None]
                best_s = min(m["total_s"] for m in measured)
                best_mb = min(m["peak_mb"] for m in measured)
                row["rule_time_vs_best"] = common.ratio(row["rule"]["total_s"], best_s)
                row["rule_memory_vs_best"] = common.ratio(row["rule"]["peak_mb"], best_mb)
                print(json.dumps(row), flush=True)
                rows.append(row)
    out = args.out or RESULTS / "long_traces.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "sizes": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
