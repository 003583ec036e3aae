"""Benchmark arithmetic: MFU, the parameter count it uses, and the shared rewards."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from benchmarks import common
from benchmarks.speed import step as step_module
from benchmarks.speed.step import config_tree


def test_mfu_is_achieved_flops_over_peak() -> None:
    # 6 * (1e6 - 2e5 head) * 1000 positions + 6 * 2e5 * 100 logits = 4.92e9 FLOPs in 2 s
    # = 2.46e9 FLOP/s; peak 1e10 -> 0.246
    flops = common.update_flops(1_000_000, 200_000, positions=1000, logits=100)
    assert flops == pytest.approx(4.92e9)
    assert common.mfu(flops, 1, 2.0, 1e10) == pytest.approx(0.246)
    # rollout: 2 * 1e6 per token; 500 tokens in 1 s = 1e9 FLOP/s; peak 1e10 -> 0.1
    assert common.mfu(common.rollout_flops_per_token(1_000_000), 500, 1.0, 1e10) == pytest.approx(
        0.1
    )
    assert math.isnan(common.mfu(1.0, 1, 0.0, 1e10))  # no time measured: no estimate


def test_matmul_params_counts_a_tied_embedding_once(tiny_model_dir) -> None:
    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    total = sum(p.numel() for p in tied.parameters())  # parameters() yields a tied tensor once
    assert common.matmul_params(tied) == total  # the one tensor is the LM head's product
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    untied = LlamaForCausalLM(config)
    # the input embedding (50 x 16 = 800) is a lookup, not a product
    assert common.matmul_params(untied) == sum(p.numel() for p in untied.parameters()) - 800


def test_rewards_shared_by_both_trainers() -> None:
    completions = ["<answer>12</answer>", "it is 7 or 12", "twelve", "<answer>1</answer>2"]
    # the last integer must equal the answer: 12, 12, none, 2
    assert common.last_integer(completions, answer=["12"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert common.answer_tag(completions) == [0.5, 0.0, 0.0, 0.5]


def test_ratio_and_median() -> None:
    assert common.ratio(3.0, 6.0) == 0.5
    assert math.isnan(common.ratio(1.0, 0.0))
    assert common.median([3.0, 1.0, 2.0]) == 2.0


def test_compare_reports_grpo_over_trl() -> None:
    from benchmarks.speed.vs_trl import compare

    def run(engine: str, steps: list[float], rss: float, rewards: list[float]) -> dict:
        return {
            "engine": engine,
            "steps": [{"step_s": s} for s in steps],
            "peak_rss_mb": rss,
            "rewards": rewards,
        }

    runs = [
        run("trl", [4.0, 6.0], 1000.0, [0.0, 0.5]),
        run("grpo", [1.0, 3.0], 700.0, [0.5, 0.5]),
        run("trl", [8.0, 5.0], 1100.0, [0.5, 1.0]),
        run("grpo", [2.0, 2.0], 800.0, [0.0, 1.0]),
    ]
    out = compare(runs)
    # medians over all steps: TRL (4, 5, 6, 8) -> 5.5, grpo (1, 2, 2, 3) -> 2.0
    assert out["step_time_ratio"] == pytest.approx(2.0 / 5.5)
    # the larger peak of each engine's runs: 800 / 1100
    assert out["peak_rss_ratio"] == pytest.approx(800 / 1100)
    # per-step median across runs: TRL (0.25, 0.75), grpo (0.25, 0.75)
    assert out["reward_curve"] == {"trl": [0.25, 0.75], "grpo": [0.25, 0.75]}


FREE_AND_MEASURE = """
import resource, sys, torch
from grpo.runtime.host_memory import set_malloc_policy
assert set_malloc_policy(sys.argv[1])
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
warm = torch.ones(2 << 20)  # an 8 MiB block, freed: glibc raises its own mmap threshold to 8 MiB
del warm
small = [torch.ones(1 << 20) for _ in range(40)]  # 40 x 4 MiB
medium = [torch.ones(3 << 20) for _ in range(20)]  # 20 x 12 MiB
large = torch.ones(24 << 20)  # 96 MiB
pin = torch.ones(1 << 20)  # stays allocated at the top, so the heap cannot simply shrink
held = resident_mib()
del small, medium, large
print(held - resident_mib())
"""


MALLOC_POLICIES = ("default", "return", "keep")


@pytest.fixture(scope="module")
def released_by_policy() -> dict[str, float]:
    """policy -> MiB the freed blocks gave back, one fresh process each (the setting is
    process-wide and cannot be undone), the processes side by side."""
    import subprocess
    import sys

    from alone import preamble

    from grpo.runtime import host_memory

    procs = {
        policy: subprocess.Popen(
            # host_memory alone, not the trainer ``import grpo`` brings
            [sys.executable, "-c", preamble(host_memory) + FREE_AND_MEASURE, policy],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for policy in MALLOC_POLICIES
    }
    outs = {policy: proc.communicate() for policy, proc in procs.items()}
    for policy, proc in procs.items():
        assert proc.returncode == 0, outs[policy][1][-2000:]
    return {policy: float(out) for policy, (out, _) in outs.items()}


@pytest.mark.parametrize(
    ("policy", "released"), [("default", (300, 370)), ("return", (460, 530)), ("keep", (80, 130))]
)
def test_malloc_policy_decides_what_freed_memory_leaves(
    released_by_policy: dict[str, float], policy: str, released: tuple
) -> None:
    low, high = released
    # freed: 160 MiB of 4 MiB blocks, 240 MiB of 12 MiB blocks, one 96 MiB block. glibc's default
    # keeps the 4 MiB ones (below its raised threshold) and unmaps the rest; "return" gives back
    # everything; "keep" keeps all but the block above its 16 MiB threshold
    assert low <= released_by_policy[policy] <= high


def test_options_summary_is_relative_to_the_first_variant() -> None:
    from benchmarks.speed.options import summarize

    def run(variant: str, steps: list[float], rss: float) -> dict:
        return {
            "variant": variant,
            "steps": [{"step_s": s, "completion_len": 10.0} for s in steps],
            "peak_rss_mb": rss,
        }

    variants = {"base": [], "lean": ["train.malloc=return"]}
    runs = [run("base", [2.0, 4.0], 1000.0), run("lean", [5.0, 7.0], 600.0)]
    runs += [run("base", [3.0, 3.0], 1200.0), run("lean", [6.0, 6.0], 500.0)]
    out = summarize(variants, runs)
    assert out["base"]["step_time_ratio"] == 1.0
    # medians over all steps: base (2, 3, 3, 4) -> 3, lean (5, 6, 6, 7) -> 6; peaks 1200 and 600
    assert out["lean"]["step_time_ratio"] == pytest.approx(2.0)
    assert out["lean"]["peak_rss_ratio"] == pytest.approx(0.5)
    assert out["lean"]["overrides"] == ["train.malloc=return"]


def test_an_options_variant_names_its_revision_and_overrides() -> None:
    from benchmarks.speed.options import parse_variant

    assert parse_variant("default=") == ("default", None, [])
    assert parse_variant("before@HEAD~1=train.malloc=return,train.threads=1") == (
        "before",
        "HEAD~1",
        ["train.malloc=return", "train.threads=1"],
    )


def test_an_options_revision_git_does_not_know_is_one_line() -> None:
    from benchmarks.speed import options

    with pytest.raises(SystemExit, match=r"@no-such-revision: no such commit"):
        options.commit_of("no-such-revision")
    assert len(options.commit_of("HEAD")) == 40


def test_an_options_revision_runs_from_its_own_worktree_removed_after(tmp_path) -> None:
    import json
    import subprocess
    from unittest import mock

    from benchmarks.speed import options

    def listed() -> str:
        git = ["git", "-C", str(options.REPO), "worktree", "list"]
        return subprocess.run(git, capture_output=True, text=True, check=True).stdout

    with options.worktrees({"HEAD"}, tmp_path) as trees:
        src = trees["HEAD"]
        assert (src / "grpo" / "__init__.py").is_file()
        assert str(src.parent) in listed()
        # a step whose grpo came from anywhere else is refused, not reported as that revision
        out = tmp_path / "run.json"

        def step(cmd, env, **kwargs):
            assert env["PYTHONPATH"].split(":")[0] == str(src)
            out.write_text(json.dumps({"grpo_source": str(options.REPO / "src" / "grpo")}))

        with mock.patch.object(options.subprocess, "run", step), pytest.raises(SystemExit):
            options.run_variant("tiny", 1, 0, [], out, src)
    assert str(src.parent) not in listed()


def test_a_terminated_options_run_removes_its_worktrees(tmp_path) -> None:
    # SIGTERM (what timeout and most schedulers send) during the runs still removes them
    import subprocess
    import sys

    from benchmarks.speed import options

    child = (
        "import os, pathlib, signal, sys, time\n"
        "from benchmarks.speed import options\n"
        "with options.worktrees({'HEAD'}, pathlib.Path(sys.argv[1])) as trees:\n"
        "    print(trees['HEAD'].parent, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=options.REPO,
    )
    tree = done.stdout.strip()
    assert tree and done.returncode != 0 and "stopped by signal" in done.stderr
    git = ["git", "-C", str(options.REPO), "worktree", "list"]
    assert tree not in subprocess.run(git, capture_output=True, text=True, check=True).stdout


def test_update_mfu_counts_the_positions_computed(tiny_config) -> None:
    # one step of G = 4 completions of 2 prompts, packed: each prompt is computed once per
    # group, so fewer positions than prompt + completion per row (what the estimate charged)
    from benchmarks.speed import step

    result = step.run(tiny_config(algorithm={"beta": 0.0}, train={"steps": 1}), warmup_peak_s=0.1)
    (only,) = result["steps"]
    assert only["generated_tokens"] < only["update_positions"] < only["trained_tokens"]
    assert only["update_logits"] <= only["update_positions"]
    assert 0 < result["mfu_update"] < 1
    stages = result["peak_rss_by_stage_mb"]
    assert set(stages) >= {"rollout", "update", "frozen_logprobs", "other"}


@pytest.mark.skipif(not step_module.StageMemory.available(), reason="needs Linux's clear_refs")
def test_stage_memory_puts_a_short_spike_in_its_own_stage(tiny_config, monkeypatch) -> None:
    # a 256 MiB tensor touched and freed within the frozen log-probs is that stage's peak and
    # the run's: read from the kernel's mark, however short the spike
    from grpo.training.update import PolicyUpdate

    frozen = PolicyUpdate.frozen_logprobs

    samplers = []

    def spiking(self, *args, **kwargs):
        torch.ones(64 << 20).sum()  # float32: 256 MiB, released to the OS when freed
        # and no thread of the benchmark runs beside the stage (a sampler takes the GIL from it)
        targets = [getattr(t, "_target", None) for t in threading.enumerate()]
        samplers.extend(
            f for f in targets if getattr(f, "__module__", "") == "benchmarks.speed.step"
        )
        return frozen(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdate, "frozen_logprobs", spiking)
    result = step_module.run(tiny_config(train={"steps": 1}), warmup_peak_s=0.1)
    stages = result["peak_rss_by_stage_mb"]
    others = max(v for k, v in stages.items() if k != "frozen_logprobs")
    assert stages["frozen_logprobs"] > others + 200
    assert result["peak_rss_mb"] == pytest.approx(stages["frozen_logprobs"], abs=0.1)
    assert samplers == []


@pytest.mark.parametrize(("bf16_gflops", "chosen"), [(1000.0, "bfloat16"), (250.0, "float32")])
@pytest.mark.parametrize("setup", ["smollm2", "smollm2-fast"])
def test_smollm2_set_ups_take_bf16_only_where_it_multiplies_clearly_faster(
    monkeypatch, bf16_gflops: float, chosen: str, setup: str
) -> None:
    peaks = {torch.float32: 200e9, torch.bfloat16: bf16_gflops * 1e9}
    monkeypatch.setattr(common, "matmul_peak_flops", lambda dtype, **_: peaks[dtype])
    fast = common.with_precision(common.SETUPS[setup], None)
    assert fast["precision"] == chosen
    # a set-up in float32 stays there, and a precision given by hand wins
    assert common.with_precision(common.SETUPS["tiny"], None)["precision"] == "float32"
    assert common.with_precision(fast, "float32")["precision"] == "float32"
    # grpo runs the chosen precision as TRL's bf16=True does: autocast over float32 weights
    tree = config_tree(fast, steps=1, seed=0, output_dir="out")
    assert tree["model"]["precision"] == ("bf16_autocast" if chosen == "bfloat16" else "float32")
