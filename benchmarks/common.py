"""Shared pieces of the benchmarks: the two benchmark set-ups, their rewards, and the arithmetic
of throughput and model-FLOPs utilisation (MFU).

MFU here is the usual "model FLOPs" estimate, not a hardware counter:
- a forward pass costs ``2 * P`` FLOPs per token and forward + backward ``6 * P``, where ``P``
  counts the parameters that take part in matrix products (the input embedding is a lookup, the
  LM head is a product; with tied embeddings they are one tensor, counted once);
- the update is charged for the positions its forwards actually computed (read from the
  model's inputs and outputs: a packed group's prompt once, padding included) with the decoder
  body's parameters, plus the LM head on the positions whose logits were computed; a
  recomputation for gradient checkpointing is not counted (model FLOPs, not hardware FLOPs),
  and neither is attention's own score arithmetic;
- rollout is charged ``2 * P`` per generated (unmasked) completion token.
The peak is a matrix product in the run's compute precision (bfloat16 under autocast, else
float32), measured in the same process, at the same moment, so a machine shared with other jobs
is measured against what it could give at that time.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

# the shared rewards live in a module without torch: grpo imports it in each reward worker
from benchmarks.rewards import answer_tag as answer_tag
from benchmarks.rewards import last_integer as last_integer
from grpo.runtime import host_memory as memory
from grpo.runtime.precision import product_timer

# ------------------------------------------------------------------------------------ set-ups

# Shared by both trainers. The rewards give credit the model can reach from where it starts
# (see FACTS: the strict format reward is never sampled by SmolLM2-135M at first). Gradient
# checkpointing is on for both: TRL's GRPOConfig turns it on by default. So is bf16 (autocast
# over float32 weights): SmolLM2 runs it on both sides where this CPU multiplies clearly faster
# in bf16 ("fastest"), else float32 on both, where TRL's default would only slow both down.
SETUPS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": "tiny-random",
        "data": {"task": "arithmetic"},
        "prompts_per_step": 4,
        "group_size": 8,
        "max_new_tokens": 32,
        "lr": 1e-4,
        "beta": 0.04,
        "loss_type": "grpo",
        "micro_batch_size": 8,
        "gradient_checkpointing": True,
        "precision": "float32",
        "steps": 12,
    },
    "smollm2": {
        "model": "smollm2-135m-instruct",
        # the default recipe's problems and system prompt, where the model starts right about a
        # quarter of the time, so reward curves can move within a few steps
        "data": {
            "task": "arithmetic",
            "task_args": {"size": 400, "min_value": 1, "max_value": 30, "operations": "+"},
            "system_prompt": (
                "Solve the arithmetic problem. Write the final answer as a number inside "
                "<answer></answer> tags."
            ),
        },
        "prompts_per_step": 4,
        "group_size": 8,
        "max_new_tokens": 64,
        "lr": 2e-5,
        "beta": 0.04,
        "loss_type": "grpo",
        "micro_batch_size": 8,
        "gradient_checkpointing": True,
        "precision": "fastest",
        "steps": 8,
    },
}


def fastest(setup: dict[str, Any]) -> dict[str, Any]:
    """Both trainers at their fastest settings for this machine: no gradient checkpointing
    (memory allows it at these sizes), the whole step (4 x 8 completions) as one micro-batch,
    TRL's anchor configuration in FACTS (beta 0.04, 64 tokens, one micro-batch of 32), and bf16
    autocast over float32 weights where this CPU multiplies faster in bf16 (``precision``).
    grpo also scores from full logits: its chunked LM head saves memory at a cost in time
    (update 1.20x in bf16, ``benchmarks.speed.levers --head``), as checkpointing does."""
    whole_step = setup["prompts_per_step"] * setup["group_size"]
    return {
        **setup,
        "gradient_checkpointing": False,
        "chunked_head": False,
        "micro_batch_size": whole_step,
        "precision": "fastest",
    }


SETUPS["tiny-fast"] = fastest(SETUPS["tiny"])
SETUPS["smollm2-fast"] = fastest(SETUPS["smollm2"])

# ------------------------------------------------------------------------------------ arithmetic


def matmul_params(model: nn.Module) -> int:
    """Parameters used in matrix products: all of them except an untied input embedding."""
    seen = {id(p): p.numel() for p in model.parameters()}
    total = sum(seen.values())
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is inp
    return total if tied else total - inp.numel()


def mfu(flops_per_token: float, tokens: float, seconds: float, peak_flops: float) -> float:
    """Achieved model FLOP/s over the peak: (flops_per_token * tokens / seconds) / peak."""
    if seconds <= 0 or peak_flops <= 0:
        return float("nan")
    return flops_per_token * tokens / seconds / peak_flops


def head_params(model: nn.Module) -> int:
    """Parameters of the LM head (the output projection)."""
    out = model.get_output_embeddings()
    return 0 if out is None else out.weight.numel()


def update_flops(params: int, head: int, positions: int, logits: int) -> float:
    """Forward + backward (6 FLOPs per parameter and token) of the decoder body over
    ``positions`` and of the LM head (``head`` of the ``params``) over ``logits`` positions."""
    return 6.0 * ((params - head) * positions + head * logits)


def rollout_flops_per_token(params: int) -> float:
    """One forward per generated token."""
    return 2.0 * params


def matmul_peak_flops(
    n: int = 1024,
    seconds: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> float:
    """FLOP/s of an n x n x n matrix product in ``dtype`` on ``device``, best of repeated
    timings (synchronised on a GPU: ``grpo.runtime.precision.product_timer``)."""
    timed = product_timer(dtype, device or torch.device("cpu"), (n, n, n))
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        best = min(best, timed())
    return 2.0 * n**3 / best


# a precision is worth switching to only for a clear gain: bf16 also rounds the activations
BF16_MIN_GAIN = 1.5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fastest_precision() -> tuple[str, dict[str, float]]:
    """ "bfloat16" where this CPU's bf16 matrix product is at least ``BF16_MIN_GAIN`` times its
    float32 one (bf16 units: AVX512-BF16, AMX), else "float32"; with both peaks in GFLOP/s."""
    peaks = {name: matmul_peak_flops(dtype=dtype) / 1e9 for name, dtype in DTYPES.items()}
    faster = peaks["bfloat16"] >= BF16_MIN_GAIN * peaks["float32"]
    return ("bfloat16" if faster else "float32"), peaks


def with_precision(setup: dict[str, Any], precision: str | None) -> dict[str, Any]:
    """The set-up with its precision decided: ``precision`` if given, else "fastest" measured."""
    chosen = precision or setup["precision"]
    if chosen == "fastest":
        chosen, peaks = fastest_precision()
        print(f"precision: {chosen} (matmul GFLOP/s {peaks})", flush=True)
    return {**setup, "precision": chosen}


# a timed `grpo train` of the default recipe: no evaluation, checkpoints or completions
TIMED_RUN = [
    "train.eval_every=0",
    "train.save_every=0",
    "train.log_completions=0",
    "train.progress=false",
    "train.resume=never",
]


def timed_steps(run_dir: Path) -> list[dict[str, Any]]:
    """A run's step rows that carry ``time/step_s``, the first left out: it carries the start
    (model load, a producer process's start)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "time/step_s" in row][1:]


# one `grpo` command in a fresh interpreter, after PATCH (Python, may be empty); prints the
# interpreter's peak RSS and its largest child's (a producer process, reward workers) in KiB last
FRESH_RUN = """
import resource, sys
exec(sys.argv[1])
from grpo.cli import main
code = main(sys.argv[2:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(code)
"""


def timed_run(run_dir: Path, args: list[str], patch: str = "") -> dict[str, Any]:
    """``grpo ARGS`` (a training into ``run_dir``) in a fresh process: its timed steps
    (``timed_steps``), its peak RSS in MiB, and apart the largest peak of its child processes
    (a producer process with ``rollout.max_staleness``, reward workers), which the first does
    not count."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_RUN, patch, *args], check=True, capture_output=True, text=True
    )
    own, children = (int(kib) / 1024 for kib in done.stdout.split()[-2:])
    return {"rows": timed_steps(run_dir), "peak_rss_mb": own, "children_peak_rss_mb": children}


def run_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every timed step of ``timed_run`` results, and the largest peak RSS."""
    rows = [r for run in runs for r in run["rows"]]
    return {
        "steps_timed": len(rows),
        "median_step_s": median([r["time/step_s"] for r in rows]),
        "median_rollout_s": median([r["time/rollout_s"] for r in rows]),
        "median_train_s": median([r["time/train_s"] for r in rows]),
        "median_completion_len": median([r["completion_len/mean"] for r in rows]),
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
        "peak_rss_mb_per_run": [run["peak_rss_mb"] for run in runs],
        "children_peak_rss_mb": max(run["children_peak_rss_mb"] for run in runs),
    }


def compare_two(
    module: str, variants: dict[str, tuple[list[str], str]], rounds: int, steps: int, out: Path
) -> dict[str, Any]:
    """Whole ``grpo train`` runs of two variants (name -> (the run's arguments, a patch run
    first; see ``timed_run``), alternated first, second, first, ... over ``rounds`` so that
    other jobs on the machine slow both alike, ``steps`` steps each (no evaluation, no
    checkpoints), each a fresh process. Per variant the ``run_summary``; then the second's
    median step, update and peak RSS over the first's. Written to ``out`` and printed."""
    first, second = variants
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, (args, patch) in variants.items():
                run = f"{name}-{r}"
                train = ["train", *args, f"train.steps={steps}", f"train.output_dir={tmp}"]
                train += [f"train.run_name={run}", *TIMED_RUN]
                runs[name].append(timed_run(Path(tmp) / run, train, patch))
    a, b = run_summary(runs[first]), run_summary(runs[second])
    report = {
        "machine": machine(),
        "command": " ".join([f"python -m {module}", *sys.argv[1:]]),
        "rounds": rounds,
        "steps_per_run": steps,
        first: a,
        second: b,
        f"{second}_over_{first}": {
            "step": b["median_step_s"] / a["median_step_s"],
            "train": b["median_train_s"] / a["median_train_s"],
            "peak_rss": b["peak_rss_mb"] / a["peak_rss_mb"],
        },
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return report


def machine() -> dict[str, Any]:
    """The CPU a measurement ran on: its model name, the flags that decide its bf16 speed
    (AVX2, AVX-512, AVX512-BF16, AMX), its cores; and the GPU, if torch sees one."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {
        key.strip(): value.strip()
        for key, value in (line.split(":", 1) for line in text.splitlines() if ":" in line)
    }
    flags = set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "cpu": fields.get("model name", "?"),
        "flags": [f for f in wanted if f in flags],
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(args: list[str], out: Path, src: Path | None = None) -> dict[str, Any]:
    """``python <args>`` in a fresh process (so its peak RSS is its own) that writes JSON to
    ``out``; returns it. The child gets this process's environment as found (a grpo run
    in it decides the kernel caches; an older revision's import did) and imports grpo from
    ``src`` when given, ahead of the installed one."""
    env = {**memory.environment_as_found(), "TQDM_DISABLE": "1"}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, *args], check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else float("nan")
