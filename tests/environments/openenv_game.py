"""An OpenEnv environment written against ``openenv-core`` alone (a hidden-number game), and a
fixture-side server: ``openenv-core``'s own app under uvicorn on 127.0.0.1, on a free port."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str


class HiddenNumber(Environment):
    """reset: a number in 1..10 drawn from the seed; step: "higher", "lower" or "right" (reward
    1, done), a reward of 0 for a wrong guess and -1 for one that is not a number."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    closed: ClassVar[list[str]] = []  # episode ids, as the server closes their sessions

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.number = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any):
        self.number = random.Random(seed).randint(1, 10)
        self._state = State(episode_id=episode_id or f"seed-{seed}", step_count=0)
        hint = f" ({row['hint']})" if "hint" in row else ""
        return GuessObservation(message=f"Guess my number, 1 to 10{hint}.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any):
        self._state.step_count += 1
        if action.guess.strip() == "boom":
            raise ValueError("the game broke")
        try:
            guess = int(action.guess.strip())
        except ValueError:
            return GuessObservation(message="That is not a number.", reward=-1.0)
        if guess == self.number:
            return GuessObservation(message="right", reward=1.0, done=True)
        said = "higher" if guess < self.number else "lower"
        return GuessObservation(message=said, reward=0.0)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        HiddenNumber.closed.append(self._state.episode_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app: Any, port: int | None = None) -> Iterator[str]:
    """``app`` under uvicorn on 127.0.0.1 in a thread; yields its http URL, stops it after."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test's OpenEnv server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def game_app(factory: Callable[[], Environment] = HiddenNumber, sessions: int = 64) -> Any:
    return create_app(factory, GuessAction, GuessObservation, max_concurrent_envs=sessions)


class DyingNumber(HiddenNumber):
    """The game, whose server process dies at its ``die_at``-th reset."""

    resets = 0
    die_at = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any):
        DyingNumber.resets += 1
        if DyingNumber.resets == DyingNumber.die_at:
            os._exit(1)
        return super().reset(seed, episode_id, **row)


if __name__ == "__main__":  # python openenv_game.py PORT DIE_AT: a server that dies mid-run
    DyingNumber.die_at = int(sys.argv[2])
    uvicorn.run(
        game_app(DyingNumber), host="127.0.0.1", port=int(sys.argv[1]), log_level="critical"
    )
