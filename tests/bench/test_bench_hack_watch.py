"""benchmarks.quality.hack_watch: the watch replayed over recorded per-step signals (what it
printed then, what it says now), and the unit-conversion task's rows."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.quality import hack_watch


def recorded(path: Path, accuracy: list[float], entropy: list[float]) -> Path:
    """A record as benchmarks.quality.r1_zero writes it; entropy_collapse as the watch logged it
    (window 5, below half of the first 5 steps' mean)."""
    n = len(accuracy)
    collapse = [
        float(i >= 4 and sum(entropy[i - 4 : i + 1]) < 0.5 * sum(entropy[:5])) for i in range(n)
    ]
    per_step = {
        "reward/accuracy/mean": accuracy,
        "reward/format/mean": [0.0] * n,
        "completion_len/mean": [20.0] * n,
        "entropy": entropy,
        "hack/template_copy": [0.0] * n,
        "hack/question_restated": [0.0] * n,
        "hack/format_only": [0.0] * n,
        "hack/length_collapse": [0.0] * n,
        "hack/entropy_collapse": collapse,
    }
    rewards = [{"name": "accuracy"}, {"name": "format"}]
    path.write_text(
        json.dumps({"runs": [{"run": path.stem, "rewards": rewards, "per_step": per_step}]})
    )
    return path


def test_a_collapse_with_accuracy_rising_was_a_warning_and_is_now_a_note(tmp_path: Path) -> None:
    # entropy 1.0 for 5 steps, then 0.3: the last 5 steps' mean is under 0.5 at step 8
    # ((1 + 1 + 0.3 * 3) / 5 = 0.58; step 9: (1 + 0.3 * 4) / 5 = 0.44)
    entropy = [1.0] * 5 + [0.3] * 5
    learning = [0.2] * 5 + [0.6] * 5  # steps 5-9's mean 0.52 against 0.2: a rise
    gamed = [0.0] * 10
    path = recorded(tmp_path / "learning.json", learning, entropy)
    (run,) = hack_watch.json_runs(path)
    assert run["before"] == [{"step": 9, "key": "hack/entropy_collapse"}]
    assert run["warnings"] == [] and run["first_warning"] is None
    assert [(n["step"], n["key"]) for n in run["notes"]] == [(9, "hack/entropy_collapse")]
    (run,) = hack_watch.json_runs(recorded(tmp_path / "gamed.json", gamed, entropy))
    assert [(w["step"], w["key"]) for w in run["warnings"]] == [(9, "hack/entropy_collapse")]
    assert run["first_warning"] == 9 and run["notes"] == []


def test_crossings_count_once_per_crossing() -> None:
    steps = [
        {"step": s, "hack/template_copy": v} for s, v in enumerate([0, 0.3, 0.4, 0.1, 0.25], 1)
    ]
    assert hack_watch.crossings(steps, {"hack/template_copy": 0.2}) == [
        {"step": 2, "key": "hack/template_copy"},
        {"step": 5, "key": "hack/template_copy"},
    ]


def test_the_unit_conversions_are_whole_numbers_and_the_files_hold_them() -> None:
    rows = hack_watch.unit_conversion_rows()
    assert len(rows) == 10 * 19 and rows[0] != hack_watch.unit_conversion_rows(seed=1)[0]
    assert {"prompt": "Convert 7 hours to minutes.", "answer": "420"} in rows
    saved = [
        json.loads(line)
        for name in ("train", "test")
        for line in (hack_watch.TASK / f"{name}.jsonl").read_text().splitlines()
    ]
    assert saved == rows  # the committed files are what `task` writes
