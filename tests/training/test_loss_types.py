"""A short run with each newer loss type trains: the weights move, and the step's metrics say
what the loss did."""

from __future__ import annotations

import json

import pytest

from grpo.training.trainer import train


@pytest.mark.parametrize(
    ("algorithm", "clip_metrics"),
    [
        ({"loss_type": "cispo", "cispo_clip_high": 0.01}, True),
        ({"loss_type": "sapo"}, False),
    ],
    ids=["cispo", "sapo"],
)
def test_a_run_with_the_loss_type_moves_the_weights(
    tiny_config, tiny_model_dir, weights, algorithm: dict, clip_metrics: bool
) -> None:
    # two passes per step (mu 2): the second sees ratios off 1, where the loss types differ
    config = tiny_config(algorithm={**algorithm, "num_iterations": 2}, train={"steps": 2})
    run_dir = train(config)
    weights.assert_moved(weights.of(tiny_model_dir), weights.of(run_dir / "final"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["grad_norm"] > 0
        assert row["ratio/max"] > row["ratio/min"]  # the second pass moved the ratios
        # cispo's clip fractions count weights cut to [0, 1.01]; sapo clips nothing
        assert ("clip_frac/high" in row) is clip_metrics
