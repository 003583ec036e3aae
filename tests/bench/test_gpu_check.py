"""tools.gpu_check: its verdicts on hand-made numbers, the weight-sync measure on a real rollout,
a part that hangs, and (slow) the whole dry run on the CPU."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.config import RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout.hf import HFEngine
from tools import gpu_check


def _row(step: int, rollout: float, train: float, loss: float = 0.1, grad_norm: float = 1.0):
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "time/rollout_s": rollout,
        "time/reward_s": 0.5,
        "time/train_s": train,
    }


def test_step_times_add_the_split_and_take_medians() -> None:
    # an eval row (no loss) is no step
    rows = [{"step": 0, "eval/accuracy": 0.5}, _row(1, 2.0, 3.0), _row(2, 1.0, 1.0), _row(3, 4, 2)]
    times = gpu_check.step_times(rows)
    assert times["step_s"] == [5.5, 2.5, 6.5]  # rollout + 0.5 s of rewards + train
    assert times["median_step_s"] == 5.5
    assert times["median_rollout_s"] == 2.0 and times["median_train_s"] == 2.0


def test_a_run_is_healthy_only_with_every_step_finite_and_some_gradient() -> None:
    good = [_row(1, 1, 1), _row(2, 1, 1, grad_norm=0.0)]
    assert gpu_check.healthy(good, 2) is None
    assert gpu_check.healthy(good, 3) == "2 steps logged, 3 expected"
    nan = [_row(1, 1, 1), _row(2, 1, 1, loss=math.nan)]
    assert gpu_check.healthy(nan, 2) == "a loss or gradient norm that is not finite at steps [2]"
    flat = [_row(1, 1, 1, grad_norm=0.0)]
    assert gpu_check.healthy(flat, 1) == "no step had a gradient"


def test_sync_verdicts() -> None:
    near, far = {"mean": 1e-5, "max": 4e-5}, {"mean": 0.1, "max": 1.4}
    assert gpu_check.sync_problem(near, far) is None
    # noise far above float32's: the weights in vLLM are not the policy's
    assert "from the policy's" in gpu_check.sync_problem({"mean": 0.02, "max": 0.1}, far)
    # as near the base as the policy: the pushes did not move what vLLM samples
    stale = {"mean": 1e-3, "max": 1e-2}
    assert "as near the base" in gpu_check.sync_problem(stale, {"mean": 2e-3, "max": 1e-2})


def test_sync_gaps_are_noise_for_the_sampling_model_and_large_for_another(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rollout = HFEngine(model, tok, RolloutConfig(max_new_tokens=8)).generate(
        ["hello", "1+1?"], [{}, {}], 4, seeds=[1, 2]
    )
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    same, moved = gpu_check.sync_gaps(model, rollout), gpu_check.sync_gaps(other, rollout)
    assert same["mean"] < 1e-5 and same["max"] < 1e-4
    assert moved["mean"] > 0.01
    assert gpu_check.sync_problem(same, moved) is None


def test_a_part_that_runs_past_its_limit_fails_and_the_check_goes_on(tmp_path) -> None:
    result = gpu_check.run_part("tests", "cpu", tmp_path, limit=0.5)
    assert result["passed"] is False and result["problem"] == "timed out after 0.5 s"
    assert 0.5 <= result["seconds"] < 10


def test_decode_verdicts() -> None:
    both = {"hf_bf16": {"tokens": 40}, "hf_bf16_compiled": {"tokens": 38}}
    assert gpu_check.decode_problem(both, compilable=True, compiled_fell_back=False) is None
    assert "fell back" in gpu_check.decode_problem(both, True, compiled_fell_back=True)
    assert "not one the compiled" in gpu_check.decode_problem(both, False, True)
    idle = {**both, "hf_bf16_compiled": {"tokens": 0}}
    assert gpu_check.decode_problem(idle, True, False) == "no tokens sampled by hf_bf16_compiled"
    assert gpu_check.decode_problem(both, True, False, graph_skips=0) is None
    assert "without CUDA graphs (3 skips" in gpu_check.decode_problem(both, True, False, 3)
    assert gpu_check.decode_problem(both, True, False, 0, recorded_later=0) is None
    assert "recorded again" in gpu_check.decode_problem(both, True, False, 0, recorded_later=4)


@pytest.mark.slow
def test_the_dry_run_passes_and_writes_its_report(tmp_path) -> None:
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "tools.gpu_check", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, cwd=gpu_check.ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == f"gpu-check: passed; {out}"
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["passed"] is True
    parts = report["parts"]
    assert parts["tests"]["counts"]["passed"] >= 5 and parts["tests"]["counts"]["failed"] == 0
    train = parts["train"]
    assert train["precision"] == "bf16_autocast" and len(train["step_s"]) == 3
    assert all(s > 0 for s in train["step_s"])
    assert train["auto_precision"]["chose"] in ("float32", "bf16_autocast")
    decode = parts["decode"]
    assert decode["passed"] is True and len(decode["rounds"]) == gpu_check.DECODE_ROUNDS
    for name in gpu_check.DECODE_VARIANTS:
        assert decode["medians"][name]["tokens_per_s"] > 0
        assert decode["medians"][name]["products_ceiling_share"] > 0
    assert parts["vllm"]["passed"] is None  # the dry run leaves vLLM out
