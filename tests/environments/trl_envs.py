"""Environment classes written to TRL's documented ``environment_factory`` contract, and nothing
else: no grpo import. A no-argument constructor, ``reset(**row)`` returning text or None, public
methods with Google-style docstrings as tools, an optional ``get_reward()``."""

import math
import random
import time


class GuessNumber:
    """A hidden number from 1 to 8, drawn at reset; each guess is answered higher, lower or
    correct."""

    def __init__(self):
        self.target = None
        self.guesses = []

    def reset(self, **kwargs):
        self.target = random.randint(1, 8)
        self.guesses = []
        self.row = kwargs
        return " Guess my number (1-8)."

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: the number guessed
        """
        self.guesses.append(n)
        if n == self.target:
            return "correct"
        return "higher" if n < self.target else "lower"

    def get_reward(self) -> float:
        return 1.0 if self.target in self.guesses else 0.0

    def _helper(self):
        return "not a tool"

    def peek(self):
        return self.target  # no docstring: a helper, not a tool


class Counter:
    """TRL's documentation example: a counter, incremented by a tool; ``reset`` adds nothing."""

    def __init__(self):
        self.count = 0

    def reset(self, **kwargs) -> None:
        self.count = 0

    def increment(self, a: int) -> int:
        """
        Increment the counter by a value.

        Args:
            a: The value to increment by

        Returns:
            The counter after the increment.
        """
        self.count += a
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class RaisingTool(GuessNumber):
    def guess(self, n: int) -> str:
        """Guess.

        Args:
            n: the number guessed
        """
        raise ValueError(f"cannot guess {n}")


class HangingTool(GuessNumber):
    def guess(self, n: int) -> str:
        """Guess.

        Args:
            n: the number guessed
        """
        time.sleep(60)
        return "late"


class RaisingReward(GuessNumber):
    def get_reward(self) -> float:
        raise RuntimeError("no score")


class NaNReward(GuessNumber):
    def get_reward(self) -> float:
        return math.nan


class RaisingReset(GuessNumber):
    def reset(self, **kwargs):
        raise KeyError("level")


class NumberReset(GuessNumber):
    def reset(self, **kwargs):
        return 7


class UnseededReset(GuessNumber):
    def reset(self, **kwargs):
        return f" {random.SystemRandom().random()}"


class NeedsArguments(GuessNumber):
    def __init__(self, level):
        super().__init__()


class NoReset:
    def act(self, x: int) -> int:
        """Act.

        Args:
            x: a number
        """
        return x


class UndocumentedArgument(GuessNumber):
    def hint(self, k: int) -> str:
        """A hint."""
        return "no"


class Closing(GuessNumber):
    closed = 0

    def close(self):
        Closing.closed += 1


class HighNumber(GuessNumber):
    """Rewards a hidden number above 4: the same for every completion of a prompt (one seed)."""

    def get_reward(self) -> float:
        return float(self.target > 4)


class ClosesWhatResetOpened(GuessNumber):
    """A close() that needs reset()'s state, a property that raises before reset, and a static
    method as a tool."""

    def reset(self, **kwargs):
        self.log = []
        return super().reset(**kwargs)

    @property
    def status(self):
        return f"{len(self.log)} calls"  # AttributeError before reset

    @staticmethod
    def rules() -> str:
        """The rules of the game."""
        return "guess from 1 to 8"

    def close(self):
        self.log.clear()


class VarArgs(GuessNumber):
    def add(self, *nums: int) -> int:
        """Add numbers.

        Args:
            nums: the numbers
        """
        return sum(nums)


class SlowReset(GuessNumber):
    def reset(self, **kwargs):
        time.sleep(0.4)
        return super().reset(**kwargs)


class Verbose(GuessNumber):
    def guess(self, n: int) -> str:
        """Guess.

        Args:
            n: the number guessed
        """
        return "x" * 5000


class Exits(GuessNumber):
    def guess(self, n: int) -> str:
        """Guess.

        Args:
            n: the number guessed
        """
        raise SystemExit(3)


class Levelled(Counter):
    """A counter whose reward scales with a constructor argument: made by a factory, as TRL's
    ``environment_factory`` may be (``functools.partial(Levelled, level=2)``)."""

    def __init__(self, level):
        super().__init__()
        self.level = level

    def get_reward(self) -> float:
        return float(self.level * (self.count + 1))


def make_levelled():
    """A factory function: ``rollout.environment: trl_envs:make_levelled``."""
    return Levelled(level=3)


class HangingReset(GuessNumber):
    def reset(self, **kwargs):
        time.sleep(1.5)  # past a 0.5 s limit (short: the abandoned call holds the seeding lock)
