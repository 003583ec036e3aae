"""``make gpu-check``: what only a GPU can show, in one run of a few minutes, as one JSON.

Four parts, each in a child process with its own time limit (a crash or a hang fails that
part, and the others still run):

- ``tests``: the tests marked ``device`` (scoring and log-probs, the chunked LM head, packing,
  prefix attention, lean decoding, HF generation, and trainer runs, resume included) with
  ``--device cuda`` (tests/conftest.py);
- ``train``: steps of the default recipe in bf16 autocast, with their times and the GPU's peak
  memory, and what ``model.precision: auto`` would choose on this device and why;
- ``decode``: the default recipe's rollout shape in bf16, eager decoding against
  ``rollout.compile`` (replayed as CUDA graphs), alternated: tokens/s against the decode limit
  and the products' ceiling, the rollout-speed benchmark's measures
  (docs/results/rollout-speed.md);
- ``vllm``: when vLLM is importable, a colocated vLLM run whose pushed weights are checked:
  after a few optimizer steps vLLM's log-probs of its own samples must match the trained
  policy's to float32 noise and differ from the base model's.

``--device cpu`` is a dry run of the same script: a hidden GPU, the tiny random model, a few
steps, two test files, the decode part on it, and no vLLM part; about a minute on 2 cores.

    .venv/bin/python -m tools.gpu_check [--device cuda|cpu] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# seconds each part may take on a GPU: under 10 minutes in all (on an H200 the tests took about
# 130 s, 100 of them the producer-process tests); decode holds a compilation of the step
LIMITS = {"tests": 200, "train": 100, "decode": 150, "vllm": 140}

# the dry run's tests: scoring on the device and the HF engine's generation, about 20 s
DRY_RUN_TESTS = ["tests/scoring/test_logprobs.py", "tests/rollout/test_rollout.py"]

# a pushed weight reaches vLLM when vLLM's log-probs of its own samples are the policy's to
# float32 noise (about 1e-5 on CPU, docs/results/vllm.md; TF32 kernels give more), and far from
# the base model's (0.1 and more after a step)
SYNC_TOLERANCE = 5e-3
SYNC_CONTRAST = 0.25

Part = Callable[[str, Path], dict[str, Any]]


# ------------------------------------------------------------------------------------ tests


class _Outcomes:
    """A pytest plugin that counts outcomes and names the failures."""

    def __init__(self) -> None:
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}
        self.failures: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.counts["failed"] += 1
            self.failures.append(f"{report.nodeid} ({report.when})")
        elif report.skipped:
            self.counts["skipped"] += 1
        elif report.when == "call":
            self.counts["passed"] += 1


def tests_part(device: str, work: Path) -> dict[str, Any]:
    """The tests marked ``device``, on ``device`` (on the CPU: two files of them)."""
    import pytest

    paths = DRY_RUN_TESTS if device == "cpu" else ["tests"]
    outcomes = _Outcomes()
    # the slow device tests too: the compiled step's CUDA-graph capture on the tiny model
    args = ["-q", "-p", "no:cacheprovider", "-m", "device", "--device", device]
    code = pytest.main([*args, *paths], plugins=[outcomes])
    passed = code == 0 and outcomes.counts["passed"] > 0
    return {
        "passed": passed,
        "exit_code": int(code),
        "counts": outcomes.counts,
        "failures": outcomes.failures,
    }


# ------------------------------------------------------------------------------------ train


def step_times(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each step's seconds (rollout + rewards + log-probs and update) and their medians."""
    steps = [r for r in rows if "loss" in r]
    split = {k: [r[f"time/{k}_s"] for r in steps] for k in ("rollout", "reward", "train")}
    total = [sum(parts) for parts in zip(*split.values(), strict=True)]
    return {
        "step_s": total,
        "median_step_s": statistics.median(total) if total else math.nan,
        **{f"median_{k}_s": statistics.median(v) if v else math.nan for k, v in split.items()},
    }


def healthy(rows: list[dict[str, Any]], steps: int) -> str | None:
    """Why a run's metrics are not those of ``steps`` sound steps, or None."""
    trained = [r for r in rows if "loss" in r]
    if len(trained) != steps:
        return f"{len(trained)} steps logged, {steps} expected"
    bad = [r["step"] for r in trained if not (math.isfinite(r["loss"]) and r["grad_norm"] >= 0)]
    if bad:
        return f"a loss or gradient norm that is not finite at steps {bad}"
    if not any(r["grad_norm"] > 0 for r in trained):
        return "no step had a gradient"
    return None


def _run_options(work: Path, name: str, steps: int) -> list[str]:
    return [
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.save_every=0",
        "train.progress=false",
        "train.sinks=[jsonl]",
        f"train.output_dir={work}",
        f"train.run_name={name}",
    ]


def _peak_memory_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def train_part(device: str, work: Path) -> dict[str, Any]:
    """Steps of the default recipe in bf16 autocast (the dry run: the tiny random model), and
    what ``model.precision: auto`` would choose here."""
    from grpo.config import load_config
    from grpo.models import mlp_shape, resolve_model_path
    from grpo.runtime.precision import choose_precision, measure_rates
    from grpo.training.trainer import Trainer

    dry = device == "cpu"
    steps = 3 if dry else 10
    overrides = ["model.precision=bf16_autocast", *_run_options(work, "train", steps)]
    if dry:
        overrides += ["model.name=tiny-random", "rollout.max_new_tokens=16"]
    trainer = Trainer(load_config(None, overrides))
    on = trainer.dist.device
    rates = measure_rates(on, *mlp_shape(resolve_model_path(trainer.config.model.name)))
    auto = {"chose": choose_precision(rates), "float32_gflops": rates.float32}
    auto["bfloat16_gflops"] = rates.bfloat16
    rows = [json.loads(line) for line in (trainer.train() / "metrics.jsonl").open()]
    problem = healthy(rows, steps)
    if on.type != device:
        problem = f"the trainer ran on {on}, not {device}"
    elif not dry and auto["chose"] != "bf16_autocast":
        problem = "model.precision=auto would not choose bf16 on this GPU"
    return {
        "passed": problem is None,
        "problem": problem,
        "model": trainer.config.model.name,
        "precision": trainer.config.model.precision,
        "auto_precision": auto,
        "peak_memory_mb": _peak_memory_mb(on),
        **step_times(rows),
    }


# ------------------------------------------------------------------------------------- vllm


def sync_gaps(model: torch.nn.Module, rollout: Any) -> dict[str, float]:
    """Mean and max |model - sampler| log-prob over a rollout's counted tokens."""
    from grpo.scoring.logprobs import completion_logprobs

    device = next(model.parameters()).device
    ids = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, *(t.to(device) for t in ids), rollout.decoding)
    mask = rollout.completion_mask.to(device)
    diff = (logp - rollout.sampler_logp.to(device)).abs()[mask]
    return {"mean": float(diff.mean()), "max": float(diff.max())}


def sync_problem(to_policy: dict[str, float], to_base: dict[str, float]) -> str | None:
    """Why vLLM's samples do not show the pushed weights, or None."""
    if to_policy["mean"] > SYNC_TOLERANCE:
        return f"vLLM's log-probs are {to_policy['mean']:.2g} from the policy's on average"
    if to_policy["mean"] > SYNC_CONTRAST * to_base["mean"]:
        return "vLLM's log-probs are as near the base model's as the trained policy's"
    return None


def vllm_part(device: str, work: Path) -> dict[str, Any]:
    """A colocated vLLM run: step times, and the pushed weights checked after the last step."""
    if importlib.util.find_spec("vllm") is None:
        return {"passed": None, "skipped": "vLLM is not installed"}
    if device == "cpu":
        return {"passed": None, "skipped": "the dry run leaves vLLM to make test-slow"}
    from transformers import AutoModelForCausalLM

    from grpo.config import dump_config, load_config
    from grpo.models import resolve_model_path
    from grpo.training.resume import open_run
    from grpo.training.trainer import Trainer

    steps = 3
    overrides = ["rollout.engine=vllm", "model.precision=float32", "optim.lr=2e-5"]
    overrides += ["rollout.prompts_per_step=2", "rollout.group_size=4"]
    trainer = Trainer(load_config(None, [*overrides, *_run_options(work, "vllm", steps)]))
    path = resolve_model_path(trainer.config.model.name)
    base = AutoModelForCausalLM.from_pretrained(path).to(trainer.dist.device).eval()
    probe = trainer.rows[-4:]
    prompts = [trainer.prompt_format.render(trainer.tokenizer, r) for r in probe]
    open_run(trainer.run, trainer.plan, dump_config(trainer.config))
    rows = []
    try:
        while trainer.state.step < steps:
            trainer.state.step += 1
            rows.append({"step": trainer.state.step, **trainer.train_step()})
        rollout = trainer.producer.engine.generate(prompts, probe, 4, seeds=[1, 2, 3, 4])
        to_policy, to_base = sync_gaps(trainer.state.policy, rollout), sync_gaps(base, rollout)
    finally:
        trainer.rewards.close()
        trainer.producer.close()
        trainer.run.release()
    problem = healthy(rows, steps) or sync_problem(to_policy, to_base)
    return {
        "passed": problem is None,
        "problem": problem,
        "vllm_vs_policy": to_policy,
        "vllm_vs_base": to_base,
        "peak_memory_mb": _peak_memory_mb(trainer.dist.device),
        **step_times(rows),
    }


# ----------------------------------------------------------------------------------- decode

DECODE_VARIANTS = ("hf_bf16", "hf_bf16_compiled")
DECODE_ROUNDS = 3


def decode_problem(
    entries: dict[str, dict[str, Any]],
    compilable: bool,
    compiled_fell_back: bool,
    graph_skips: int | None = None,
    recorded_later: int | None = None,
) -> str | None:
    """Why the decode part's rollouts do not show both ways of decoding working, or None.
    Where the compiled step should replay CUDA graphs: ``graph_skips``, how many times inductor
    ran it without them; ``recorded_later``, inductor's count of the non-static inputs of the
    graphs it recorded after the first round (every round has the same shapes, so any is a graph
    recorded anew: an input whose address moved)."""
    idle = [name for name, e in entries.items() if not e.get("tokens")]
    if idle:
        return f"no tokens sampled by {', '.join(idle)}"
    if not compilable:
        return "the model is not one the compiled decode step takes (rollout.compile)"
    if compiled_fell_back:
        return "the compiled decode step fell back to eager decoding (its line says why)"
    if graph_skips:
        return (
            f"the compiled decode step ran without CUDA graphs ({graph_skips} skips; "
            "TORCH_LOGS=perf_hints says why)"
        )
    if recorded_later:
        return "the compiled decode step's CUDA graphs were recorded again after the first round"
    return None


def decode_part(device: str, work: Path) -> dict[str, Any]:
    """The default recipe's rollout shape in bf16, eager against ``rollout.compile`` (replayed
    as CUDA graphs on a GPU), alternated over ``DECODE_ROUNDS`` rounds (the first holds the
    compilation): tokens/s against the decode limit and the products' ceiling, as
    ``benchmarks.speed.rollout_speed`` measures them, and how many completions the compiled
    step samples otherwise from the same seeds. The dry run: the tiny random model."""
    from torch._dynamo.utils import counters

    from benchmarks.speed import rollout_speed
    from grpo.rollout import compiled

    setup = rollout_speed.default_setup(
        "tiny-random" if device == "cpu" else None, torch.device(device)
    )
    sampling = rollout_speed.variants(setup.model, setup.tokenizer, setup.rollout, DECODE_VARIANTS)
    skipped_before = counters["inductor"]["cudagraph_skips"]
    recorded = "cudagraph_recorded_non_static_inputs"
    rounds, differing = [], []
    for r in range(DECODE_ROUNDS):
        entry, rollouts = rollout_speed.measure_round(setup, sampling, r)
        rounds.append(entry)
        differing.append(
            rollout_speed.differences(*(rollouts[n] for n in reversed(DECODE_VARIANTS)))
        )
        if r == 0:  # the compilation and the graphs' first recordings are this round's
            recorded_after_first = counters["inductor"][recorded]
    takes = compiled.compilable(setup.model)
    fell_back = not compiled.wanted(True, setup.model)
    graphs = torch.device(device).type in compiled.GRAPHED_DEVICES
    skips = counters["inductor"]["cudagraph_skips"] - skipped_before if graphs else None
    later = counters["inductor"][recorded] - recorded_after_first if graphs else None
    problems = (
        decode_problem({n: e[n] for n in sampling}, takes, fell_back, skips, later) for e in rounds
    )
    problem = next((p for p in problems if p), None)
    return {
        "passed": problem is None,
        "problem": problem,
        "model": setup.model.config.name_or_path,
        "cuda_graphs": graphs,
        "cudagraph_skips": skips,
        "cudagraph_inputs_recorded_after_round_1": later,
        "medians": rollout_speed.medians(rounds, list(sampling)),
        "compiled_against_eager": differing,
        "rounds": rounds,
    }


PARTS: dict[str, Part] = {
    "tests": tests_part,
    "train": train_part,
    "decode": decode_part,
    "vllm": vllm_part,
}


# ------------------------------------------------------------------------------------ driver


def run_part(name: str, device: str, work: Path, limit: float) -> dict[str, Any]:
    """Part ``name`` in a child process (a hidden GPU on the dry run), within ``limit`` seconds."""
    out = work / f"{name}.json"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "tools.gpu_check", "--part", name, "--device", device]
    t0 = time.perf_counter()
    try:
        done = subprocess.run([*cmd, "--work", str(work)], cwd=ROOT, env=env, timeout=limit)
    except subprocess.TimeoutExpired:
        result = {"passed": False, "problem": f"timed out after {limit:g} s"}
    else:
        if out.is_file():
            result = json.loads(out.read_text())
        else:
            result = {"passed": False, "problem": f"the child exited with {done.returncode}"}
    return {**result, "seconds": round(time.perf_counter() - t0, 1)}


def machine(device: str) -> dict[str, Any]:
    """What the check ran on."""
    info: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    else:
        info["threads"] = torch.get_num_threads()
    return info


def check(device: str, out: Path, limits: dict[str, float]) -> dict[str, Any]:
    """Every part on ``device``; the report written to ``out``."""
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report: dict[str, Any] = {"started": started, **machine(device), "parts": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        for name in PARTS:
            result = run_part(name, device, Path(folder), limits[name])
            report["parts"][name] = result
            print(f"gpu-check {name}: {_verdict(result)} ({result['seconds']} s)", flush=True)
    report["passed"] = all(p["passed"] is not False for p in report["parts"].values())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _verdict(result: dict[str, Any]) -> str:
    if result["passed"] is None:
        return f"skipped: {result['skipped']}"
    return "passed" if result["passed"] else f"FAILED: {result.get('problem') or result}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, help="default: runs/gpu-check/<device>.json")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:  # a child: one part, its result where the driver reads it
        result = PARTS[args.part](args.device, args.work)
        (args.work / f"{args.part}.json").write_text(json.dumps(result, indent=2))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu-check: torch {torch.__version__} sees no CUDA device; install a CUDA build of "
            "torch (https://pytorch.org/get-started/locally/), or run the dry run: --device cpu",
            file=sys.stderr,
        )
        return 2
    out = args.out or ROOT / "runs" / "gpu-check" / f"{args.device}.json"
    report = check(args.device, out, LIMITS)
    print(f"gpu-check: {'passed' if report['passed'] else 'FAILED'}; {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
