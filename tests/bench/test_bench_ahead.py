"""The arithmetic of benchmarks.speed.ahead and benchmarks.speed.ppo_vs_grpo on made-up rows,
and the machine description every timing carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.speed import ahead


def row(step: float, rollout: float, train: float, **more: float) -> dict[str, float]:
    return {
        "time/step_s": step,
        "time/rollout_s": rollout,
        "time/reward_s": 0.0,
        "time/train_s": train,
        "completion_len/mean": 20.0,
        **more,
    }


def test_busy_shares_of_a_step_ahead() -> None:
    # a 10 s step: the trainer waited 1 s for rollouts (busy 0.9), the producer generated 6 s
    # (busy 0.6): both were busy at least 0.9 + 0.6 - 1 = 0.5 of it
    rows = [row(10.0, 6.0, 8.0, **{"time/wait_rollout_s": 1.0, "time/wait_train_s": 4.0})] * 3
    out = ahead.per_k(rows)
    assert out["steps_per_min"] == pytest.approx(6.0)
    assert out["trainer_busy_share"] == pytest.approx(0.9)
    assert out["producer_busy_share"] == pytest.approx(0.6)
    assert out["both_busy_share"] == pytest.approx(0.5)
    assert "trainer_busy_share" not in ahead.per_k([row(10.0, 6.0, 4.0)])  # k = 0: no waits


def test_a_summary_takes_medians_and_the_largest_peak() -> None:
    runs = [
        {"rows": [row(2.0, 1.0, 1.0), row(4.0, 1.0, 3.0)], "peak_rss_mb": 100.0},
        {"rows": [row(3.0, 1.0, 2.0)], "peak_rss_mb": 120.0},
    ]
    for run, children in zip(runs, (30.0, 20.0), strict=True):
        run["children_peak_rss_mb"] = children
    out = common.run_summary(runs)
    assert out["median_step_s"] == 3.0 and out["median_train_s"] == 2.0
    assert out["peak_rss_mb"] == 120.0 and out["steps_timed"] == 3
    assert out["children_peak_rss_mb"] == 30.0  # apart: a producer's memory is its own


def test_timed_steps_leave_out_the_first_and_the_evaluations(tmp_path: Path) -> None:
    lines = [{"step": 0, "eval/accuracy": 0.5}, row(9.0, 1, 1), row(2.0, 1, 1), row(3.0, 1, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [r["time/step_s"] for r in common.timed_steps(tmp_path)] == [2.0, 3.0]


def test_the_machine_names_its_cpu_and_flags() -> None:
    machine = common.machine()
    assert machine["cpu"] and machine["cores"] >= 1
    assert set(machine["flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_compare_two_times_fresh_runs_and_divides_the_second_by_the_first(
    tmp_path: Path, capsys
) -> None:
    # benchmarks.speed.windowed and ppo_vs_grpo: two variants of the smoke recipe, the second
    # with 2 completions per prompt instead of 8 (fewer tokens to generate and train on); one
    # round of real runs (the alternation over rounds is the next test's)
    variants = {
        "eight": (["recipes/smoke.yaml"], ""),
        "two": (["recipes/smoke.yaml", "rollout.group_size=2"], ""),
    }
    out = tmp_path / "report.json"
    report = common.compare_two("benchmarks.x", variants, rounds=1, steps=3, out=out)
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == report
    eight, two = report["eight"], report["two"]
    assert eight["steps_timed"] == two["steps_timed"] == 2  # the first step of each run left out
    assert len(eight["peak_rss_mb_per_run"]) == len(two["peak_rss_mb_per_run"]) == 1
    ratio = report["two_over_eight"]
    assert ratio["step"] == two["median_step_s"] / eight["median_step_s"]
    assert ratio["peak_rss"] == two["peak_rss_mb"] / eight["peak_rss_mb"]
    assert ratio["train"] < 1  # a quarter of the completions to score and train on
    assert eight["children_peak_rss_mb"] > 0  # the math-verify worker, at least


def test_compare_two_alternates_the_variants_round_by_round(tmp_path: Path, monkeypatch) -> None:
    # so that other jobs on the machine slow both alike: first, second, first, second, ...
    started = []

    def timed_run(run_dir: Path, args: list[str], patch: str) -> dict:
        started.append((run_dir.name, patch, [a for a in args if not a.startswith("train.")]))
        assert f"train.run_name={run_dir.name}" in args and "train.steps=4" in args
        return {"rows": [row(2.0, 1.0, 1.0)], "peak_rss_mb": 10.0, "children_peak_rss_mb": 0.0}

    monkeypatch.setattr(common, "timed_run", timed_run)
    variants = {"a": (["r.yaml"], "patch a"), "b": (["r.yaml", "x=1"], "")}
    report = common.compare_two("benchmarks.x", variants, rounds=3, steps=4, out=tmp_path / "o")
    assert [name for name, _, _ in started] == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2"]
    assert started[:2] == [
        ("a-0", "patch a", ["train", "r.yaml"]),
        ("b-0", "", ["train", "r.yaml", "x=1"]),
    ]
    assert report["a"]["peak_rss_mb_per_run"] == [10.0] * 3 and report["b"]["steps_timed"] == 3
