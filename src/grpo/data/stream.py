"""The prompt stream: which dataset row each step draws, and the seed its completions use."""

from __future__ import annotations

import random
from typing import Any, NamedTuple


class Draw(NamedTuple):
    """One prompt taken from the data stream: row index, epoch, position in the stream."""

    index: int
    epoch: int
    position: int


class PromptStream:
    """An endless, seeded stream of dataset rows, reshuffled every epoch.

    The state is one integer (rows consumed), so resuming needs nothing else.
    """

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool) -> None:
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def next_draw(self) -> Draw:
        """The next row: its index in ``rows``, its epoch and its position in the stream."""
        epoch, pos = divmod(self.consumed, len(self.rows))
        self.consumed += 1
        return Draw(self._order(epoch)[pos], epoch, self.consumed - 1)

    def take(self, n: int) -> list[dict[str, Any]]:
        return [self.rows[self.next_draw().index] for _ in range(n)]


def sampling_seed(seed: int, position: int) -> int:
    """Seed of the G samples of the prompt drawn at stream ``position`` (unique over a run).

    Depends on neither the rank nor the batch the prompt lands in, so W ranks sample exactly what
    one process with the same global batch samples, and a resumed run what an uninterrupted one does.
    """
    return (seed << 40) ^ position
