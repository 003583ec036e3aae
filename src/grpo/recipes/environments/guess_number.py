"""Guess the number: an environment class written to TRL's ``environment_factory`` contract
(no grpo import), for ``recipes/guess-number.yaml``.

A number from 1 to ``HIGH`` is hidden, drawn from the row's ``seed`` column: each game is fixed
by its row, and the held-out games are rows never trained on. The model calls ``guess(n)`` and is
told ``higher``, ``lower`` or ``correct``; a game is won when one guess is correct. With two
guesses (a third is refused) a fixed sequence finds 2 numbers of 3; 2, then 1 after "lower"
and 3 after "higher", finds all 3, so what a model gains past 2/3 it gains by reading the answers.
"""

import random

HIGH = 3
GUESSES = 2  # a game's guesses: more are refused


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
            n: the number guessed, from 1 to 3
        """
        if len(self.guesses) >= GUESSES:
            return f"no guesses left (you had {GUESSES})"
        self.guesses.append(n)
        if n == self.target:
            return "correct"
        return "higher" if n < self.target else "lower"

    def get_reward(self) -> float:
        """1 when a guess was correct, else 0."""
        return float(self.target in self.guesses)
