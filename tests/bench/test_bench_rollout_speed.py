"""The arithmetic of benchmarks.speed.rollout_speed: the decode limit, the token comparison of
two rollouts and the product timing, on made-up rollouts and a tiny model."""

from __future__ import annotations

import pytest
import torch

from benchmarks.speed import rollout_speed
from grpo.step_data import Rollout


def test_the_decode_limit_is_the_slower_of_streaming_and_computing() -> None:
    # 1e6 weights: float32 streams 4e6 bytes (0.4 ms at 1e10 B/s); 8 rows compute 1.6e7 FLOPs
    # (1.6 ms at 1e10 FLOP/s): compute-bound, 8 / 1.6 ms = 5000 tokens/s
    limit = rollout_speed.decode_limit(10**6, 8, bandwidth=1e10, peak=1e10)
    assert limit["stream_s"] == pytest.approx(4e-4)
    assert limit["tokens_per_s"] == pytest.approx(5000)
    # one row at a fast peak is bandwidth-bound, and bf16 streams half the bytes
    assert rollout_speed.decode_limit(10**6, 1, 1e10, 1e15)["tokens_per_s"] == pytest.approx(2500)
    bf16 = rollout_speed.decode_limit(10**6, 1, 1e10, 1e15, bytes_per_weight=2)
    assert bf16["tokens_per_s"] == pytest.approx(5000)


def _rollout(ids: list[list[int]], lengths: list[int], logps: list[list[float]]) -> Rollout:
    ids_t = torch.tensor(ids)
    mask = torch.arange(ids_t.shape[1])[None] < torch.tensor(lengths)[:, None]
    return Rollout(
        prompt_ids=torch.zeros(len(ids), 1, dtype=torch.long),
        prompt_mask=torch.ones(len(ids), 1, dtype=torch.long),
        completion_ids=ids_t,
        completion_mask=mask,
        truncated=torch.zeros(len(ids), dtype=torch.bool),
        prompts=[""] * len(ids),
        completions=[""] * len(ids),
        rows=[{}] * len(ids),
        group_size=1,
        sampler_logp=torch.tensor(logps),
    )


def test_differences_count_completions_and_compare_log_probs_where_tokens_agree() -> None:
    # row 0 the same tokens (padding after the end differs, and is not a token); row 1 differs
    # at its second token; row 2 is longer in one rollout: another completion
    got = _rollout(
        [[1, 2, 9], [1, 3, 0], [4, 0, 0]], [2, 3, 1], [[-1.0, -2.0, 0], [0, 0, 0], [0, 0, 0]]
    )
    want = _rollout(
        [[1, 2, 7], [1, 4, 0], [4, 5, 0]], [2, 3, 2], [[-1.5, -2.25, 5], [0, 0, 0], [0, 0, 0]]
    )
    assert rollout_speed.differences(got, want) == {
        "completions": 3,
        "differing": 2,
        "max_logp_diff_where_same": 0.5,
    }


def test_product_times_cover_every_row_count_and_both_ways() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    out = rollout_speed.product_times(model, rows=(1, 4))
    assert set(out) == {1, 4}
    for n, row in out.items():
        flops = 2 * n * (16 * 32 + 32 * 8)
        assert row["f_linear_gflops"] == pytest.approx(flops / row["f_linear_s"] / 1e9)
        assert row["packed_over_f_linear"] == pytest.approx(row["packed_s"] / row["f_linear_s"])
