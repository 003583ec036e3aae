"""Rollout speed: the HF engine in each precision, and vLLM's CPU build where installed, against
the decode limit of this machine.

Every variant samples the default recipe's shape (P prompts x G completions, ``max_new_tokens``,
temperature 1) from the same SmolLM2 weights, alternated round by round in one process so that
other jobs on the machine slow them alike:

- ``hf_float32``: float32, ``F.linear``'s products (float32 sampling by default);
- ``hf_float32_packed``: float32 with ``rollout.pack_float32`` (oneDNN's packed products where
  timed faster: its first round includes that timing);
- ``hf_bf16``: bf16 autocast (packed bf16 products), as the default recipe samples where
  ``model.precision: auto`` picks bf16;
- ``vllm``: float32, a weight push (``sync_weights``) before each rollout as in training; only
  where vLLM is installed (``make vllm``).

A variant's limit is measured in the same process at the same time: a decode step streams every
weight once for the whole batch (memory bandwidth, at its precision's bytes) and does
``2 x params`` FLOPs per row (the matrix-product peak in its precision); tokens/s can be no more
than ``rows / max(bytes / bandwidth, flops / peak)``. Beside it, each HF variant's products
ceiling: a decode step's products alone (every linear layer once, in model order, at the batch's
rows, as the variant multiplies them: ``decode_products``), timed in the same round; the tokens/s
a rollout would reach if nothing but its products took time, and its share of the limit. The
packed float32 completions are compared with the float32 ones of the same seeds: how many
differ, and the largest log-prob difference of those that do not. ``--profile``: one more rollout of each HF variant under torch's profiler,
its wall time split into matrix products, attention, dtype casts, other tensor ops and the
Python around them, and the model's matrix products alone (all of a decode step's, on its own
weights, at 1 to 128 rows): ``F.linear`` against oneDNN's packed products.

    .venv/bin/python -m benchmarks.speed.rollout_speed --rounds 5 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from benchmarks import common
from grpo.build import build_engine
from grpo.config import RolloutConfig, load_config
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.models import load_tokenizer, resolve_model_path
from grpo.rollout import compiled, packed_weights, render_prompt
from grpo.runtime.precision import bf16_autocast, synchronize
from grpo.step_data import Rollout

CPU = torch.device("cpu")


# sums timed between two synchronisations: on a GPU one sum of 0.5 GiB takes a fraction of a
# millisecond, which the synchronisation and the launch would otherwise inflate
SUMS = {"cpu": 1, "cuda": 10}


def memory_bandwidth(gib: float = 0.5, seconds: float = 1.0, device: torch.device = CPU) -> float:
    """Bytes/s read by a sum over a float32 buffer larger than the caches, best of repeats."""
    buffer = torch.ones(int(gib * 2**30) // 4, device=device)
    sums = SUMS.get(device.type, 1)
    buffer.sum()  # warm-up: the kernel's first launch
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(sums):
            buffer.sum()
        synchronize(device)
        best = max(best, sums * buffer.numel() * 4 / (time.perf_counter() - t0))
    return best


def decode_limit(
    params: int, rows: int, bandwidth: float, peak: float, bytes_per_weight: int = 4
) -> dict[str, float]:
    """Tokens/s bound for ``rows`` active rows: weights read once per step, 2 FLOPs per weight."""
    stream_s = params * bytes_per_weight / bandwidth
    compute_s = 2 * params * rows / peak
    return {
        "stream_s": stream_s,
        "compute_s": compute_s,
        "tokens_per_s": rows / max(stream_s, compute_s),
    }


@dataclass
class Setup:
    """The default recipe's rollout: its settings, the model (float32), its tokenizer, the
    dataset's rows and the system prompt."""

    rollout: RolloutConfig
    model: torch.nn.Module
    tokenizer: Any
    rows: list[dict[str, Any]]
    system: str | None


def default_setup(model: str | None = None, device: torch.device = CPU) -> Setup:
    """The default recipe's rollout, loaded: its model, or ``model`` (a name or alias), on
    ``device``."""
    recipe = load_config()
    path = resolve_model_path(model or recipe.model.name)
    return Setup(
        recipe.rollout,
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval(),
        load_tokenizer(path),
        load_dataset_rows(recipe.data, recipe.train.seed),
        system_prompt_for(recipe.data),
    )


def round_prompts(setup: Setup, r: int) -> tuple[list[dict[str, Any]], list[str], list[int]]:
    """Round ``r``'s rows, their rendered prompts and their seeds."""
    p = setup.rollout.prompts_per_step
    batch = setup.rows[r * p : (r + 1) * p]
    prompts = [render_prompt(setup.tokenizer, row["prompt"], setup.system) for row in batch]
    return batch, prompts, list(range(r * p, (r + 1) * p))


# the side of the square product whose rate stands for a device's peak: a GPU needs larger
# products than a CPU to reach its own
PEAK_SIDE = {"cpu": 1024, "cuda": 4096}


def machine_now(device: torch.device = CPU) -> dict[str, Any]:
    """Memory bandwidth and the matrix-product peak of each precision, measured now."""
    n = PEAK_SIDE.get(device.type, 1024)
    peaks = {
        name: common.matmul_peak_flops(n, dtype=dtype, device=device)
        for name, dtype in common.DTYPES.items()
    }
    return {"bandwidth_bytes_per_s": memory_bandwidth(device=device), "matmul_peak_flops": peaks}


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class Variant:
    """One way of sampling: its engine, the precision it multiplies in, the autocast around it."""

    def __init__(self, engine: Any, precision: str, autocast: bool) -> None:
        self.engine, self.precision, self.autocast = engine, precision, autocast

    def sample(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Rollout, float]:
        """(rollout, seconds), a weight push included (nothing to do for the HF engine)."""
        with bf16_autocast(_device(model), self.autocast):
            start = time.perf_counter()
            self.engine.sync_weights(model)
            out = self.engine.generate(*args, **kwargs)
            synchronize(_device(model))
            return out, time.perf_counter() - start


def variants(
    model: torch.nn.Module,
    tokenizer: Any,
    rollout: RolloutConfig,
    names: tuple[str, ...] | None = None,
) -> dict[str, Variant]:
    """The variants named (default: every one; vLLM's where it is installed), built: a vLLM
    engine is started only when asked for."""

    def hf(**update: Any) -> Any:
        return build_engine(
            "hf", model=model, tokenizer=tokenizer, config=rollout.model_copy(update=update)
        )

    built: dict[str, Callable[[], Variant]] = {
        "hf_float32": lambda: Variant(hf(compile=False), "float32", False),
        "hf_float32_packed": lambda: Variant(
            hf(pack_float32=True, compile=False), "float32", False
        ),
        "hf_float32_compiled": lambda: Variant(hf(compile=True), "float32", False),
        "hf_bf16": lambda: Variant(hf(compile=False), "bfloat16", True),
        "hf_bf16_compiled": lambda: Variant(hf(compile=True), "bfloat16", True),
    }
    if importlib.util.find_spec("vllm") is not None:
        built["vllm"] = lambda: Variant(
            build_engine(
                "vllm",
                model=model,
                tokenizer=tokenizer,
                config=rollout.model_copy(update={"engine": "vllm"}),
            ),
            "float32",
            False,
        )
    unknown = set(names or ()) - set(built)
    if unknown:
        raise ValueError(f"no variant {', '.join(sorted(unknown))} here (have {', '.join(built)})")
    return {name: make() for name, make in built.items() if names is None or name in names}


def differences(got: Rollout, want: Rollout) -> dict[str, Any]:
    """How many completions of ``got`` differ from ``want``'s (same seeds), and the largest
    sampled log-prob difference over the completions that are the same."""
    differing, largest = 0, 0.0
    for i in range(len(got.completion_ids)):
        ours, theirs = got.completion_mask[i], want.completion_mask[i]
        if not torch.equal(got.completion_ids[i][ours], want.completion_ids[i][theirs]):
            differing += 1
            continue
        delta = (got.sampler_logp[i][ours] - want.sampler_logp[i][theirs]).abs()
        largest = max(largest, float(delta.max()) if len(delta) else 0.0)
    return {
        "completions": len(got.completion_ids),
        "differing": differing,
        "max_logp_diff_where_same": largest,
    }


# profiler op name -> where its time goes (anything else: "other ops")
OP_KINDS = {
    "aten::mm": "products",
    "aten::addmm": "products",
    "mkldnn::_linear_pointwise": "products",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::copy_": "casts and copies",
}


def profile(
    variant: Variant, model: torch.nn.Module, *args: Any, **kwargs: Any
) -> dict[str, float]:
    """One rollout under torch's profiler: seconds by kind of op (self time), and the rest of
    the wall time as "python" (the loop, dispatch, the profiler's own cost)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        _, seconds = variant.sample(model, *args, **kwargs)
    kinds = dict.fromkeys(["products", "attention", "casts and copies", "other ops"], 0.0)
    for event in prof.key_averages():
        kinds[OP_KINDS.get(event.key, "other ops")] += event.self_cpu_time_total / 1e6
    return {"wall_s": seconds, **kinds, "python": seconds - sum(kinds.values())}


@contextlib.contextmanager
def decode_products(
    variant: Variant, model: torch.nn.Module, inputs: dict[int, torch.Tensor]
) -> Iterator[Callable[[], list[torch.Tensor]]]:
    """A pass over every linear layer of ``model`` once, in model order, the head included: a
    decode step's products and nothing else, multiplied as ``variant``'s step multiplies them
    (packed where its engine's session packs; on weights cast once per rollout where it decodes
    compiled). ``inputs``: a float32 [rows, width] input for each input width. Passes follow one
    another as decode steps do, so a weight stays in cache from one to the next as much as it
    would between steps (SmolLM2's 269 MB in bf16 against a Xeon's 300 MiB L3, shared)."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with bf16_autocast(_device(model), variant.autocast), variant.engine.session():
        if compiled.wanted(variant.engine.config.compile, model):
            cast = compiled.weights(model, compiled.sampling_dtype(model))
            linears = compiled.linears(cast)
            x = {k: t.to(cast.head.weight.dtype) for k, t in inputs.items()}
            yield lambda: [F.linear(x[w.weight.shape[1]], w.weight, w.bias) for w in linears]
        else:
            yield lambda: [m(inputs[m.in_features]) for m in layers]


@torch.no_grad()
def products_ceiling(
    variant: Variant, model: torch.nn.Module, rows: int, repeats: int = 5
) -> dict[str, float]:
    """The tokens/s ``variant`` could reach if a decode step took its products' time alone:
    ``rows`` over the best of ``repeats`` timed passes of ``decode_products``."""
    device = _device(model)
    widths = {m.in_features for m in model.modules() if type(m) is torch.nn.Linear}
    inputs = {k: torch.randn(rows, k, device=device) for k in widths}
    best = float("inf")
    with decode_products(variant, model, inputs) as run:
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            best = min(best, time.perf_counter() - start)
    return {"products_s": best, "products_ceiling_tokens_per_s": rows / best}


@torch.no_grad()
def product_times(
    sampling: dict[str, Variant], model: torch.nn.Module, rows: tuple[int, ...] = (1, 8, 32, 128)
) -> dict:
    """Seconds of one pass over every linear layer of ``model`` (``decode_products``) at each
    row count, float32 through ``F.linear`` (``hf_float32``) and on oneDNN's packed weights
    (``hf_float32_packed``), best of 3 each, with GFLOP/s."""
    ways = {"f_linear": sampling["hf_float32"], "packed": sampling["hf_float32_packed"]}
    weights = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    out = {}
    for n in rows:
        best = {
            name: products_ceiling(v, model, n, repeats=3)["products_s"] for name, v in ways.items()
        }
        out[n] = {
            **{f"{name}_s": s for name, s in best.items()},
            **{f"{name}_gflops": 2 * n * weights / s / 1e9 for name, s in best.items()},
            "packed_over_f_linear": best["packed"] / best["f_linear"],
        }
    return out


MEDIAN_KEYS = (
    "tokens_per_s",
    "limit_tokens_per_s",
    "share_of_limit",
    "products_ceiling_tokens_per_s",
    "products_ceiling_share",
)


def measure_round(
    setup: Setup, sampling: dict[str, Variant], r: int
) -> tuple[dict[str, Any], dict[str, Rollout]]:
    """Round ``r``: the machine's bandwidth and peaks now, then each variant's rollout of the
    round's prompts, its tokens/s against its decode limit and (HF variants) its products'
    ceiling; and the rollouts."""
    model, p, g = setup.model, setup.rollout.prompts_per_step, setup.rollout.group_size
    params = sum(t.numel() for t in model.parameters())
    batch, prompts, seeds = round_prompts(setup, r)
    entry: dict[str, Any] = machine_now(_device(model))
    bandwidth, peaks = entry["bandwidth_bytes_per_s"], entry["matmul_peak_flops"]
    rollouts = {}
    for name, variant in sampling.items():
        out, seconds = variant.sample(model, prompts, batch, g, seeds=seeds)
        rollouts[name] = out
        tokens = int(out.completion_mask.sum())
        size = 2 if variant.precision == "bfloat16" else 4
        limit = decode_limit(params, p * g, bandwidth, peaks[variant.precision], size)
        entry[name] = {
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "limit_tokens_per_s": limit["tokens_per_s"],
            "share_of_limit": tokens / seconds / limit["tokens_per_s"],
        }
        if name.startswith("hf"):  # vLLM multiplies in its own kernels: no pass of ours is its
            ceiling = products_ceiling(variant, model, p * g)
            share = ceiling["products_ceiling_tokens_per_s"] / limit["tokens_per_s"]
            entry[name].update(ceiling, products_ceiling_share=share)
    return entry, rollouts


def medians(rounds: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, float]]:
    """Each variant's medians over the rounds after the first (the first holds vLLM's warm-up,
    the float32 packing's timing and the compilations), or over the one round there is."""
    later = rounds[1:] or rounds
    return {
        name: {
            key: common.median([e[name][key] for e in later])
            for key in MEDIAN_KEYS
            if key in later[0][name]
        }
        for name in names
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/rollout_speed_precisions.json")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    setup = default_setup()
    rollout, model, tokenizer = setup.rollout, setup.model, setup.tokenizer
    rows, system = setup.rows, setup.system
    p, g = rollout.prompts_per_step, rollout.group_size
    sampling = variants(model, tokenizer, rollout)
    result: dict[str, Any] = {
        "machine": common.machine(),
        "float32_packed": packed_weights._kernels(torch.float32),  # else the same as hf_float32
        "shape": {"prompts": p, "group_size": g, "max_new_tokens": rollout.max_new_tokens},
        "rounds": [],
    }
    for r in range(args.rounds):
        entry, rollouts = measure_round(setup, sampling, r)
        entry["float32_packed_against_float32"] = differences(
            rollouts["hf_float32_packed"], rollouts["hf_float32"]
        )
        result["rounds"].append(entry)
        print(json.dumps(entry), flush=True)
    result["median_after_round_1"] = medians(result["rounds"], list(sampling))
    result["float32_packed_against_float32"] = {
        "completions": sum(
            e["float32_packed_against_float32"]["completions"] for e in result["rounds"]
        ),
        "differing": sum(
            e["float32_packed_against_float32"]["differing"] for e in result["rounds"]
        ),
    }
    print(json.dumps(result["median_after_round_1"]))
    if args.profile:
        batch = rows[:p]
        prompts = [render_prompt(tokenizer, row["prompt"], system) for row in batch]
        result["profile"] = {
            name: profile(variant, model, prompts, batch, g, seeds=list(range(p)))
            for name, variant in sampling.items()
            if name.startswith("hf")
        }
        result["float32_products"] = product_times(sampling, model)
        print(json.dumps(result["profile"]), json.dumps(result["float32_products"]))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
