"""The prompt stream's schedule: the order of its rows per epoch, its draws and their
sampling seeds (the learning-rate schedule is tests/training/test_optimizer.py)."""

from __future__ import annotations

from grpo.data.stream import PromptStream, sampling_seed


def test_prompt_stream_is_seeded_and_covers_each_epoch() -> None:
    rows = [{"i": i} for i in range(5)]
    a, b = PromptStream(rows, seed=3, shuffle=True), PromptStream(rows, seed=3, shuffle=True)
    first = a.take(5)
    assert sorted(r["i"] for r in first) == list(range(5))  # one epoch visits every row once
    assert [r["i"] for r in first] == [r["i"] for r in b.take(5)]
    second = a.take(5)
    assert sorted(r["i"] for r in second) == list(range(5))
    assert [r["i"] for r in PromptStream(rows, 0, shuffle=False).take(7)] == [0, 1, 2, 3, 4, 0, 1]


PINNED_ORDERS = {  # two epochs of 8 rows for seeds 0 and 7 (Python's seeded random.shuffle)
    0: [4, 1, 5, 2, 0, 3, 7, 6, 3, 6, 1, 5, 7, 0, 4, 2],
    7: [3, 1, 6, 2, 5, 4, 7, 0, 5, 0, 3, 6, 4, 1, 7, 2],
}


def test_prompt_order_is_a_fixed_function_of_seed_and_epoch() -> None:
    # a checkpoint stores only the number of rows consumed: a run resumed by another build of
    # grpo must see the same stream, so each (seed, epoch) order is pinned here
    rows = [{"i": i} for i in range(8)]
    orders = {
        seed: [r["i"] for r in PromptStream(rows, seed, shuffle=True).take(16)] for seed in (0, 7)
    }
    assert orders == PINNED_ORDERS


def test_draws_name_their_row_epoch_and_stream_position() -> None:
    # 2 rows, unshuffled: (row, epoch, position) for the first 5 draws of the stream
    stream = PromptStream([{"i": 0}, {"i": 1}], seed=0, shuffle=False)
    draws = [tuple(stream.next_draw()) for _ in range(5)]
    assert draws == [(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3), (0, 2, 4)]


def test_sampling_seeds_are_unique_and_pinned() -> None:
    # one seed per (run seed, stream position): no two prompts of a run, nor two run seeds at
    # the same position, sample alike
    assert len({sampling_seed(s, p) for s in range(3) for p in range(1000)}) == 3000
    # the same numbers on every machine and version, as the prompt order: (seed << 40) ^ position
    assert sampling_seed(0, 7) == 7
    assert sampling_seed(3, 5) == 3 * 2**40 + 5
