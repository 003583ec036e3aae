"""Where the policy update's time goes: one update under torch's profiler, split by kind of op,
with the FLOP rate of its matrix products against the machine's measured peak.

    .venv/bin/python -m benchmarks.speed.update_profile --setup smollm2-fast \
        --out benchmarks/results/update_profile_smollm2-fast.json   # [--precision bfloat16]

A trainer of the set-up (``benchmarks.speed.step``'s config) runs ``--warmup`` steps, then the
next step's update (forward, backward, LM head, optimizer; the frozen log-probs are outside it)
runs under the profiler. Self time of each op goes to a kind: matrix products (forward and
backward), attention, the optimizer's ops, casts and copies, other tensor ops; the rest of the
update's wall time is Python. ``products_gflops`` is the products' FLOPs (the profiler's count)
over their time; ``mfu_products`` and ``mfu_update`` divide it, and the update's FLOPs over its
wall, by the peak of a 1024^3 product in the compute precision measured just before.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import common
from benchmarks.speed.step import config_tree
from grpo import build
from grpo.config import build_config
from grpo.models import resolve_model_path
from grpo.training.trainer import Trainer

KINDS = {
    "products": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
    "attention": ("scaled_dot_product", "flash_attention"),
    "optimizer": ("_foreach", "adam", "lerp", "addcdiv", "Optimizer"),
    "casts and copies": ("aten::copy_", "aten::_to_copy"),
}


def kind(name: str) -> str:
    lowered = name.lower()
    for label, marks in KINDS.items():
        if any(mark.lower() in lowered for mark in marks):
            return label
    return "other ops"


class Profiled:
    """The trainer's ``PolicyUpdate`` with its next call run under the profiler."""

    def __init__(self, update: Any) -> None:
        self.inner, self.result = update, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            start = time.perf_counter()
            out = self.inner(*args, **kwargs)
            wall = time.perf_counter() - start
        self.result = (prof, wall)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="smollm2-fast")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--precision", choices=["float32", "bfloat16"], help="default: the set-up's (as vs_trl)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    setup = common.with_precision(common.SETUPS[args.setup], args.precision)
    with tempfile.TemporaryDirectory() as out:
        config = build_config(config_tree(setup, args.warmup + 1, 0, out))
        build.prepare_process(config)
        config = build.concrete_precision(
            config, resolve_model_path(config.model.name), torch.device("cpu")
        )
        dtype = torch.bfloat16 if config.model.autocast else torch.float32
        trainer = Trainer(config)
        for _ in range(args.warmup):
            trainer.state.step += 1
            trainer.train_step()
        peak = common.matmul_peak_flops(dtype=dtype)
        profiled = trainer.update = Profiled(trainer.update)
        trainer.state.step += 1
        trainer.train_step()
        trainer.producer.rewards.close()
    prof, wall = profiled.result
    seconds = dict.fromkeys([*KINDS, "other ops"], 0.0)
    flops = dict.fromkeys(seconds, 0.0)
    for event in prof.key_averages():
        seconds[kind(event.key)] += event.self_cpu_time_total / 1e6
        flops[kind(event.key)] += event.flops or 0
    result = {
        "machine": common.machine(),
        "setup": args.setup,
        "precision": str(dtype).removeprefix("torch."),
        "peak_gflops": peak / 1e9,
        "update_wall_s": wall,
        "seconds": {**seconds, "python": wall - sum(seconds.values())},
        "products_gflops": flops["products"] / seconds["products"] / 1e9,
        "mfu_products": flops["products"] / seconds["products"] / peak,
        "mfu_update": sum(flops.values()) / wall / peak,
        "top_ops": [
            {"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
