"""The README's with/without-tool table: what `benchmarks.quality.tools_table` reads from a run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.quality.tools_table import summarize


def _turn(text: str, output: str | None) -> dict:
    return {"text": text, "call": None, "output": output, "error": None, "time_s": None}


def test_summary_of_a_hand_written_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "completions").mkdir(parents=True)
    steps = [
        {"step": 0, "eval/accuracy": 0.5, "eval/examples": 4.0, "eval/tools/call_frac": 1.0},
        *(
            {
                "step": s,
                "reward/mean": r,
                "tools/call_frac": c,
                "tools/error_rate": 0.0,
                "frac_zero_std": 0.5,
                "completion_len/mean": 40.0,
                "time/rollout_s": 1.0,
                "time/reward_s": 0.5,
                "time/train_s": 2.0,
            }
            for s, r, c in [(1, 0.25, 0.5), (2, 0.75, 1.0), (3, 1.0, 1.0), (4, 1.0, 1.0)]
        ),
        {"step": 4, "eval/accuracy": 1.0, "eval/examples": 4.0, "eval/tools/call_frac": 1.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    records = [
        # the answer is the tool's output; a wrong answer after a call; no call at all
        {"completion": "<answer>408</answer>", "turns": [_turn("c", "408"), _turn("a", None)]},
        {"completion": "<answer>40</answer>", "turns": [_turn("c", "408\n"), _turn("a", None)]},
        {"completion": "<answer>7</answer>", "turns": [_turn("a", None)]},
        {"completion": "<answer>408</answer>", "turns": [_turn("c", "408\n"), _turn("a", None)]},
    ]
    (run / "completions" / "step-000001.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    out = summarize(run)
    assert out["steps"] == 4
    # halves: (0.25 + 0.75) / 2 = 0.5 and (1 + 1) / 2 = 1; mean 3 / 4 = 0.75
    assert out["reward_mean_first_half"] == 0.5 and out["reward_mean_second_half"] == 1.0
    assert out["reward_mean"] == 0.75
    assert out["call_frac_first_half"] == 0.75 and out["call_frac_second_half"] == 1.0
    assert out["eval_accuracy_by_step"] == {"0": 0.5, "4": 1.0}
    assert out["answer_is_tool_output_share"] == 0.5  # 2 of the 4 logged completions
    assert out["step_time_s"] == pytest.approx(4 * 3.5)


def test_a_run_without_tools_has_no_call_shares(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "completions").mkdir(parents=True)
    row = {"step": 1, "reward/mean": 0.0, "frac_zero_std": 1.0, "completion_len/mean": 12.0}
    times = {"time/rollout_s": 1.0, "time/reward_s": 0.0, "time/train_s": 1.0}
    (run / "metrics.jsonl").write_text(json.dumps({**row, **times}) + "\n")
    (run / "completions" / "step-000001.jsonl").write_text(
        json.dumps({"completion": "<answer>5</answer>"}) + "\n"
    )
    out = summarize(run)
    assert math.isnan(out["call_frac_first_half"]) and math.isnan(
        out["answer_is_tool_output_share"]
    )
    assert out["eval_accuracy_by_step"] == {}
