"""`grpo curate`: pass rates from the recipe's own rewards, the band, resume, and training on
the kept rows. The reward (`toy_rewards.hashed_pass`) passes a row's samples with the row's own
`pass_prob`, so which rows are mixed is under the test's control."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

import grpo.curate
import grpo.rollout
from grpo.cli import main
from grpo.curate import (
    CurateSettings,
    default_output,
    group_scores,
    pass_rate,
    score_columns,
    summarize,
)
from grpo.rewards import RewardOutput

TOY = Path(__file__).parents[1] / "toy_rewards.py"
HASHED = {"name": f"{TOY}:hashed_pass"}
K = 8


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _data(tmp_path: Path) -> tuple[Path, list[dict]]:
    """12 rows with a custom prompt column: pass_prob 0 (never), 1 (always), 0.5 (mixed)."""
    rows = [
        {"question": f"What is {i} + {i}?", "answer": str(2 * i), "pass_prob": p, "id": i}
        for i, p in enumerate([0.0, 1.0, 0.5, 0.5] * 3)
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def _recipe(tmp_path: Path, tiny_model_dir: Path, **sections: dict) -> Path:
    tree: dict = {
        "model": {"name": str(tiny_model_dir), "precision": "float32"},
        "data": {"path": "data.jsonl", "prompt_field": "question"},  # relative: the recipe's folder
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "rewards": {"functions": [HASHED]},
        "optim": {"micro_batch_size": 8},
        "train": {
            "steps": 1,
            "output_dir": str(tmp_path / "runs"),
            "progress": False,
            "sinks": ["jsonl"],
        },
    }
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


# ------------------------------------------------------------------------------ pure functions


def test_group_scores_pass_rate_and_columns_by_hand() -> None:
    # 2 prompts x K=2, functions a (weight 1) and b (weight 0.5, None on one completion)
    out = RewardOutput(
        per_function=torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, math.nan], [1.0, 1.0]]),
        names=["a", "b"],
        weights=torch.tensor([1.0, 0.5]),
        errors={},
    )
    groups = group_scores(out, 2)
    # totals: 1.0, 0.5 | 1.0 (None counts 0), 1.5; b's mean skips the None
    assert groups == [
        {"sample_rewards": [1.0, 0.5], "reward_means": {"a": 0.5, "b": 0.5}},
        {"sample_rewards": [1.0, 1.5], "reward_means": {"a": 1.0, "b": 1.0}},
    ]
    assert pass_rate([1.0, 0.5], 1.0) == 0.5  # the threshold itself passes
    assert pass_rate([1.0, 0.5], 0.5) == 1.0
    cols = score_columns(7, [1.0, 0.5], {"a": 0.5}, threshold=1.0)
    # mean 0.75, population std 0.25 (as the advantage's)
    assert cols["source_row"] == 7 and cols["pass_rate"] == 0.5
    assert cols["reward_mean"] == pytest.approx(0.75) and cols["reward_std"] == pytest.approx(0.25)


def test_summary_counts_band_and_zero_variance() -> None:
    records = [
        {"pass_rate": r, "reward_std": s}
        for r, s in [(0.0, 0.0), (0.5, 0.5), (1.0, 0.0), (0.25, 0.4)]
    ]
    summary = summarize(records, CurateSettings(samples=4, band=(0.25, 0.75)), skipped=1)
    assert summary["kept"] == 2  # 0.5 and 0.25: the band's ends are inside it
    assert summary["passes_histogram"] == {"0/4": 1, "1/4": 1, "2/4": 1, "3/4": 0, "4/4": 1}
    assert summary["zero_std_frac"] == 0.5 and summary["zero_std_frac_kept"] == 0.0
    assert summary["pass_rate_mean"] == pytest.approx(0.4375)
    assert summary["skipped_rows"] == 1


def test_default_output_is_next_to_the_data() -> None:
    from grpo.config import build_config

    tree = {"data": {"path": "/data/train.parquet"}}
    assert default_output(build_config(tree)) == Path("/data/train.curated.jsonl")
    assert default_output(build_config({})) == Path("arithmetic-train.curated.jsonl")


# ------------------------------------------------------------------------------- end to end


def test_band_keeps_the_mixed_rows_with_their_own_columns(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    _, rows = _data(tmp_path)
    recipe = _recipe(tmp_path, tiny_model_dir)
    out = tmp_path / "kept.jsonl"
    args = ["curate", str(recipe), "--samples", str(K), "--output", str(out)]
    assert main([*args, "--batch-size", "16"]) == 0
    assert (
        f"train on the kept prompts: grpo train {tmp_path / 'kept.yaml'}" in capsys.readouterr().out
    )

    scores = _read(tmp_path / "kept.scores.jsonl")
    assert [s["source_row"] for s in scores] == list(range(1, 13))
    for score, row in zip(scores, rows, strict=True):
        assert {k: score[k] for k in row} == row  # the source columns, untouched
        assert len(score["sample_rewards"]) == K
        assert score["pass_rate"] == sum(r >= 1 for r in score["sample_rewards"]) / K
    rate = {s["id"]: s["pass_rate"] for s in scores}
    assert all(rate[r["id"]] == r["pass_prob"] for r in rows if r["pass_prob"] in (0, 1))
    mixed = [r["id"] for r in rows if 0.1 <= rate[r["id"]] <= 0.9]
    assert len(mixed) >= 4  # of the six 0.5 rows; a 0.5 row is all-pass or all-fail 1 time in 128

    kept = _read(out)
    assert kept == [r for r in rows if r["id"] in mixed]  # same rows, same columns, in order
    meta = json.loads((tmp_path / "kept.curate.json").read_text())
    assert meta["summary"]["kept"] == len(mixed) and meta["summary"]["prompts"] == 12
    assert meta["summary"]["zero_std_frac_kept"] == 0.0

    # the recipe's own prompt_field reads the kept file: training sees only the kept rows
    train = ["train", str(recipe), f"data.path={out}", "train.steps=2", "train.log_completions=8"]
    assert main(train) == 0
    logged = [
        r
        for f in sorted((tmp_path / "runs" / "recipe" / "completions").iterdir())
        for r in _read(f)
    ]
    questions = {f"What is {i} + {i}?" for i in mixed}
    assert len(logged) == 16 and all(
        sum(q in row["prompt"] for q in questions) == 1 for row in logged
    )

    # a new band and threshold re-filter the stored rewards without sampling again
    def no_sampling(*a, **k):
        raise AssertionError("sampled again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo.curate, "sample_and_score", no_sampling)
        assert main([*args, "--keep", "0,1"]) == 0
        assert _read(out) == rows
        assert main([*args, "--keep", "1,1", "--threshold", "0"]) == 0  # every total >= 0
        assert _read(out) == rows
        assert all(s["pass_rate"] == 1.0 for s in _read(tmp_path / "kept.scores.jsonl"))


def test_resume_samples_only_the_missing_rows_and_matches_a_fresh_run(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    _data(tmp_path)
    recipe = _recipe(tmp_path, tiny_model_dir)
    fresh = tmp_path / "fresh.jsonl"
    assert main(["curate", str(recipe), "--samples", "4", "--output", str(fresh)]) == 0
    out = tmp_path / "part.jsonl"
    args = ["curate", str(recipe), "--samples", "4", "--output", str(out), "--batch-size", "8"]
    assert main([*args, "--limit", "5"]) == 0
    scores = tmp_path / "part.scores.jsonl"
    # a kill mid-write leaves a partial last line: it is dropped and its prompt sampled again
    text = scores.read_text()
    scores.write_text(text[: len(text) - 20])

    sampled: list[int] = []
    real = grpo.curate.sample_and_score

    def counting(config, settings, rows, todo, path):
        sampled.extend(rows.numbers[i] for i in todo)
        result = real(config, settings, rows, todo, path)
        # before the final rewrite: the new batches went after the last whole line
        assert [r["source_row"] for r in _read(path)] == list(range(1, 13))
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo.curate, "sample_and_score", counting)
        assert main(args) == 0
    assert "dropped a partial last line" in capsys.readouterr().err
    assert sampled == list(range(5, 13))
    # seeded by row number: batches and the resume change nothing
    assert _read(scores) == _read(tmp_path / "fresh.scores.jsonl")
    assert _read(out) == _read(fresh)


def test_a_stopped_run_keeps_its_batches_and_resumes(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    _data(tmp_path)
    recipe = _recipe(tmp_path, tiny_model_dir)
    out = tmp_path / "kept.jsonl"
    args = ["curate", str(recipe), "--samples", "4", "--output", str(out), "--batch-size", "16"]
    real = grpo.build.build_engine

    def build_engine(*a, **k):
        engine = real(*a, **k)
        generate, calls = engine.generate, []

        def stopping(*a, **k):
            calls.append(1)
            if len(calls) == 2:  # SIGTERM (what a scheduler sends) during the second batch
                os.kill(os.getpid(), signal.SIGTERM)
            return generate(*a, **k)

        engine.generate = stopping
        return engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo.build, "build_engine", build_engine)
        assert main(args) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "curate stopped by SIGTERM" in err and "run the same command to resume" in err
    scores = tmp_path / "kept.scores.jsonl"
    assert [r["source_row"] for r in _read(scores)] == [1, 2, 3, 4]  # the first batch, whole
    assert not out.exists()
    assert main(args) == 0
    assert "8 prompts x 4 samples to score (4 already in" in capsys.readouterr().err
    assert [r["source_row"] for r in _read(scores)] == list(range(1, 13))


def test_samples_are_those_training_draws(tmp_path: Path, tiny_model_dir: Path) -> None:
    # unshuffled, the trainer's step 1 rolls out rows 1 and 2 at stream positions 0 and 1: the
    # same seeds, prompts, engine and rewards as curate's (batched otherwise), so the same
    # completions and rewards, float for float
    _data(tmp_path)
    recipe = _recipe(
        tmp_path,
        tiny_model_dir,
        data={"shuffle": False},
        rewards={"functions": [{"name": f"{TOY}:lowercase_share"}]},
        train={"log_completions": 8},
    )
    out = tmp_path / "kept.jsonl"
    assert main(["curate", str(recipe), "--samples", "4", "--output", str(out)]) == 0
    assert main(["train", str(recipe)]) == 0
    logged = _read(tmp_path / "runs" / "recipe" / "completions" / "step-000001.jsonl")
    scores = _read(tmp_path / "kept.scores.jsonl")
    assert [r["reward"] for r in logged] == scores[0]["sample_rewards"] + scores[1][
        "sample_rewards"
    ]
    assert len(set(scores[0]["sample_rewards"])) > 1  # not one value repeated


def test_bad_input_is_one_line_exit_2(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    data, rows = _data(tmp_path)
    recipe = _recipe(tmp_path, tiny_model_dir)
    out = tmp_path / "kept.jsonl"
    assert (
        main(["curate", str(recipe), "--samples", "2", "--limit", "2", "--output", str(out)]) == 0
    )
    capsys.readouterr()

    def one_line(argv: list[str], message: str) -> None:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err

    # other settings than the stored samples were drawn with
    one_line(
        ["curate", str(recipe), "--samples", "4", "--limit", "2", "--output", str(out)],
        "kept.scores.jsonl was sampled with other settings (samples 2 -> 4)",
    )
    # the data changed under the stored scores
    data.write_text("".join(json.dumps({**r, "id": -1}) + "\n" for r in rows))
    one_line(
        ["curate", str(recipe), "--samples", "2", "--limit", "2", "--output", str(out)],
        "row 1 differs from the data's row 1",
    )
    # a scores file given as data
    one_line(
        ["curate", str(recipe), f"data.path={tmp_path / 'kept.scores.jsonl'}"],
        "data row 1 already has the column 'source_row'",
    )
    one_line(["curate", str(recipe), "data.path=/no/such.jsonl"], "data file not found")
    one_line(
        ["curate", str(recipe), "--output", str(tmp_path / "kept.csv")],
        "the kept rows are written as JSONL",
    )
    with pytest.raises(SystemExit) as exit_:
        main(["curate", str(recipe), "--keep", "0.9,0.1"])
    assert exit_.value.code == 2
    assert "needs 0 <= LOW <= HIGH <= 1" in capsys.readouterr().err


def test_training_reads_the_curated_rows_of_a_task(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    # a built-in task: the kept rows train through the written recipe, with the task's system
    # prompt and its held-out split (data.eval_path) carried over
    recipe = _recipe(
        tmp_path,
        tiny_model_dir,
        data={
            "task": "arithmetic",
            "task_args": {"size": 12},
            "path": None,
            "prompt_field": "prompt",
        },
        train={"eval_every": 1, "eval_examples": 2, "log_completions": 8},
    )
    out = tmp_path / "curated" / "arith.jsonl"
    out.parent.mkdir()
    assert main(["curate", str(recipe), "--samples", "4", "--output", str(out)]) == 0
    kept = _read(out)
    assert 0 < len(kept) < 12 and set(kept[0]) == {"prompt", "answer"}
    curated = yaml.safe_load((out.parent / "arith.yaml").read_text())
    assert curated["data"]["path"] == "arith.jsonl" and curated["data"]["task"] is None
    assert curated["data"]["system_prompt"].startswith("You are a helpful assistant.")
    assert curated["data"]["eval_path"] == "arith.heldout.jsonl"

    assert main(["train", str(out.parent / "arith.yaml"), "train.steps=2"]) == 0
    run = tmp_path / "runs" / "recipe-curated"
    logged = [row for f in sorted((run / "completions").iterdir()) for row in _read(f)]
    kept_prompts = {row["prompt"] for row in kept}
    assert len(logged) == 2 * 8  # 2 steps x (2 prompts x G=4)
    for row in logged:  # each rendered prompt: the task's system prompt and a kept question
        assert "You are a helpful assistant." in row["prompt"]
        assert sum(p in row["prompt"] for p in kept_prompts) == 1
    metrics = _read(run / "metrics.jsonl")
    assert any("eval/accuracy" in m for m in metrics)  # the held-out file was read
