"""`grpo report`: a static report.html with embedded PNG plots, a summary, and completions."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.runs.report import ReportError, read_metrics, running_mean, summary, write_report
from grpo.training.trainer import train

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def embedded_pngs(text: str) -> list[bytes]:
    return [
        base64.b64decode(b) for b in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
    ]


def fake_run(run_dir: Path, steps: int = 20) -> None:
    """reward/mean = step / 100; eval at steps 0 and 20; completions at steps 1 and 20."""
    run_dir.mkdir(parents=True)
    lines = [{"step": 0, "eval/accuracy": 0.1}]
    for step in range(1, steps + 1):
        lines.append(
            {
                "step": step,
                "reward/mean": step / 100,
                "reward/format/mean": 0.5,
                "reward/accuracy/mean": step / 200,
                "kl": 0.001 * step,
                "entropy": 1.0,
                "completion_len/mean": 40.0,
                "clip_frac/low": 0.0,
                "clip_frac/high": 0.01,
                "frac_zero_std": 0.25,
                "reflection_rate": 0.0,
            }
        )
    lines[-1]["eval/accuracy"] = 0.4
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run_dir / "completions").mkdir()
    for step, text in ((1, "early <answer>3</answer>"), (steps, "late & final")):
        record = {"step": step, "prompt": "What is 1 + 2?", "completion": text, "reward": 1.0}
        record["rewards"] = {"accuracy": 1.0, "format": None}
        (run_dir / "completions" / f"step-{step:06d}.jsonl").write_text(json.dumps(record) + "\n")
    (run_dir / "config.yaml").write_text("model:\n  name: tiny\n")


def test_report_of_a_synthetic_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fake_run(run_dir)
    out = write_report(run_dir)
    assert out == run_dir / "report.html"
    text = out.read_text()
    pngs = embedded_pngs(text)
    # reward, eval, KL, entropy, length, clip fractions, zero-std groups, reflection; no
    # truncated_frac was logged, so that plot is left out
    assert len(pngs) == 8
    assert all(p.startswith(PNG_SIGNATURE) for p in pngs)
    # completions are HTML-escaped, early and late
    assert "early &lt;answer&gt;3&lt;/answer&gt;" in text and "late &amp; final" in text
    assert "Early: step 1" in text and "Late: step 20" in text
    assert "name: tiny" in text


def test_summary_numbers_by_hand(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fake_run(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    table = {name.split(" ")[0]: (first, last) for name, first, last in summary(rows)}
    # first ten steps: mean(1..10)/100 = 0.055; last ten: mean(11..20)/100 = 0.155
    assert table["reward/mean"] == ("0.055", "0.155")
    # accuracy is half the reward: 0.0275 and 0.0775 (printed with 3 decimals)
    assert table["reward/accuracy/mean"] == ("0.028", "0.077")
    assert table["eval/accuracy"] == ("0.100", "0.400")


def test_report_of_a_real_tiny_run(tiny_config, capsys) -> None:
    run_dir = train(tiny_config(train={"steps": 2, "eval_every": 2, "eval_examples": 2}))
    assert main(["report", str(run_dir)]) == 0
    assert "report.html" in capsys.readouterr().out
    text = (run_dir / "report.html").read_text()
    # reward, eval, KL (beta > 0 by default), entropy, length, clip, zero-std, reflection,
    # truncation, reward-hacking signals
    assert len(embedded_pngs(text)) == 10
    assert "Held-out evaluation" in text and "Reward-hacking signals" in text


def test_report_plots_and_sums_up_the_reward_hacking_signals(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fake_run(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:  # a copy that spreads: 5% of completions more each step
        row["hack/template_copy"] = 0.05 * row["step"]
        row["hack/format_only"] = float(row["step"] >= 15)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    text = write_report(run_dir).read_text()
    assert len(embedded_pngs(text)) == 9  # the synthetic run's 8, and the signals
    assert "alt='Reward-hacking signals" in text
    table = {name.split(" ")[0]: (first, last) for name, first, last in summary(rows)}
    # 0.05 x mean(1..10) = 0.275 and 0.05 x mean(11..20) = 0.775
    assert table["hack/template_copy"] == ("0.275", "0.775")


def test_report_errors(tmp_path: Path, capsys) -> None:
    with pytest.raises(ReportError, match=r"no metrics\.jsonl"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "run directory not found" in err and err.count("\n") == 1
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ReportError, match="line 2 is not valid JSON"):
        write_report(tmp_path)


def test_report_skips_a_partial_last_line(tmp_path: Path, capsys) -> None:
    # what a run killed while writing leaves (a resumed run repairs it; a report may come first)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5}]
    assert "skipped the partial last line 2" in capsys.readouterr().out


def test_running_mean_by_hand() -> None:
    # trailing windows of 2: [1], [1, 2], [2, 3], [3, 4]
    assert running_mean([1.0, 2.0, 3.0, 4.0], window=2) == [1.0, 1.5, 2.5, 3.5]
    assert running_mean([], window=3) == []
