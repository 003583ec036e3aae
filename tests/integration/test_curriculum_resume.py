"""A run with a curriculum survives kill -9: its level and window are in every checkpoint and
its rows a function of (level, stream position), so a chain of SIGKILLed lives ends with the
weights, metrics (``curriculum/level`` among them) and completions of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from run_logs import kill_chain, step_rows
from test_resume import STEPS, TRAINABLE_REWARD, assert_same_run, weights


@pytest.mark.slow
def test_a_curriculum_run_killed_at_random_points_resumes_bit_identical(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tree = {
        "model": {"name": str(tiny_model_dir), "precision": "float32"},
        "data": {
            "task": "reasoning_gym",
            "task_args": {"name": "chain_sum", "size": 16},
            # the tiny random model passes nothing: with a window of 2 steps below lower, the
            # level goes 3, 3, 2, 2 (and 1 after the last step), so a resume must restore both
            # the level and a half-full window
            "curriculum": {"enabled": True, "start_level": 3, "window": 2, "lower": 0.5},
        },
        # the trainable reward moves the weights; reasoning_gym counts the passes
        "rewards": {
            "functions": [{"name": TRAINABLE_REWARD}, {"name": "reasoning_gym"}],
            "workers": 1,
        },
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "algorithm": {"beta": 0.0},
        "optim": {"lr": 1e-2, "micro_batch_size": 8},
        "train": {
            "steps": STEPS,
            "save_every": 1,
            "keep_last": 2,
            "log_completions": 2,
            "threads": 1,
            "progress": False,
            "sinks": ["jsonl"],
        },
    }
    lives = kill_chain(tree, tmp_path, seed=1, timeout=1800)
    killed = [life for life in lives[1:] if life["killed"]]
    assert lives[-1]["exit"] == 0 and all(life["killed"] or life["exit"] == 0 for life in lives)
    assert len(killed) >= 3, lives
    straight, chain = tmp_path / "straight", tmp_path / "chain"
    levels = [row["curriculum/level"] for row in step_rows(straight)]
    assert levels == [3.0, 3.0, 2.0, 2.0]
    assert [row["curriculum/pass_rate"] for row in step_rows(straight)] == [0.0] * STEPS
    start, moved = weights(tiny_model_dir), weights(straight / "final")
    assert max(float((moved[k] - start[k]).abs().max()) for k in moved) > 1e-2
    assert_same_run(chain, straight)
