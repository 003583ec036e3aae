"""Guess the number: an environment class written to TRL's ``environment_factory`` contract
(no grpo import), for ``recipes/guess-number.yaml``.

A number from 1 to ``HIGH`` is hidden, drawn from the row's ``seed`` column: each game is fixed
by its row, and the held-out games are rows never trained on. The model calls ``guess(n)`` and is
told ``higher``, ``lower`` or ``correct``; a game is won when one guess is correct. With three
guesses a fixed sequence finds 3 numbers of 5; halving the range on each answer finds all 5, so
what a model gains past 0.6 it gains by reading the answers.
"""

import random

HIGH = 5


class GuessNumber:
    def __init__(self):
        self.target = None
        self.guesses = []

    def reset(self, **row):
        self.target = random.Random(row["seed"]).randint(1, HIGH)
        self.guesses = []
        return None  # the row's prompt says it all

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: the number guessed, from 1 to 5
        """
        self.guesses.append(n)
        if n == self.target:
            return "correct"
        return "higher" if n < self.target else "lower"

    def get_reward(self) -> float:
        """1 when a guess was correct, else 0."""
        return float(self.target in self.guesses)
