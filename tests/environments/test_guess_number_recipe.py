"""recipes/guess-number.yaml and its environment: the recipe resolves its files, and the game
is what its docstring says (higher/lower answers; two guesses find every number only by
reading them; a third is refused)."""

from __future__ import annotations

from pathlib import Path

from grpo.build import environment_of
from grpo.config import load_config
from grpo.environments.classes import load_class

RECIPES = Path(__file__).parents[2] / "src" / "grpo" / "recipes"


def _play(cls, seed: int, policy) -> tuple[float, int]:
    game = cls()
    game.reset(prompt="p", seed=seed)
    answer = None
    for turn in range(3):  # a third guess is refused
        answer = game.guess(policy(turn, answer, game.guesses))
        if answer == "correct":
            break
    return game.get_reward(), len(game.guesses)


def test_the_recipe_resolves_its_environment_and_data() -> None:
    config = load_config(str(RECIPES / "guess-number.yaml"))
    assert config.rollout.environment == f"{RECIPES / 'environments/guess_number.py'}:GuessNumber"
    assert Path(config.data.path).is_file() and Path(config.data.eval_path).is_file()
    environment = environment_of(config)
    assert environment.name == "GuessNumber" and list(environment.signatures) == ["guess"]
    assert environment.has_reward and environment.stop == ["\n```\n"]


def test_only_a_policy_that_reads_the_answers_wins_every_game() -> None:
    cls = load_class(f"{RECIPES / 'environments/guess_number.py'}:GuessNumber")
    seeds = range(10000, 10060)  # the held-out games

    def halving(turn, answer, guesses):  # 2, then the middle of what is left
        low, high = 1, 3
        for g, a in zip(guesses, answers, strict=True):
            low, high = (g + 1, high) if a == "higher" else (low, g - 1)
        return (low + high + 1) // 2 if guesses else 2

    def fixed(turn, answer, guesses):
        return (2, 3, 1)[turn]  # the third is refused: 2 and 3 are what it plays

    answers: list[str] = []

    def recording(policy):
        def play(turn, answer, guesses):
            if answer is not None:
                answers.append(answer)
            return policy(turn, answer, guesses)

        return play

    won = []
    for seed in seeds:
        answers.clear()
        won.append(_play(cls, seed, recording(halving)))
    assert all(reward == 1.0 and guesses <= 2 for reward, guesses in won)
    fixed_won = [_play(cls, seed, fixed) for seed in seeds]
    targets = [_target(cls, seed) for seed in seeds]
    assert [reward for reward, _ in fixed_won] == [float(t in (2, 3)) for t in targets]
    assert all(guesses <= 2 for _, guesses in fixed_won)  # the third guess was refused
    assert 0.5 < sum(t in (2, 3) for t in targets) / len(seeds) < 0.8


def _target(cls, seed: int) -> int:
    game = cls()
    game.reset(prompt="p", seed=seed)
    return game.target
