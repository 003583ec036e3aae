"""``grpo env-serve``: any grpo environment (an environment class, the Python tool) behind
``openenv-core``'s own server, so a run reaches it as ``openenv+http://HOST:PORT`` and plays it
as it does in process (``grpo.environments.openenv``).

Each OpenEnv session holds one episode of the environment: ``reset(seed, row=...)`` starts it
(the observation's ``text``: the start text, or None), ``step`` acts on the call the run's side
read from the model's turn, and the session's ``state`` carries the episode's ``reward``
(computed when asked, as the loop asks once after the last turn); closing the session closes
the episode. Two routes describe the environment to the run: ``GET /grpo/environment`` (name,
tool schemas, stop strings) and ``POST /grpo/action`` (a turn's text -> its action, by the
environment's own parser, or null).
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

from grpo.environments import Action as TurnCall
from grpo.environments import Environment as GrpoEnvironment
from grpo.environments import Episode


class TurnAction(Action):
    call: Any = None


class TurnObservation(Observation):
    text: str | None = None
    output: str | None = None
    error: str | None = None


class EpisodeSession(Environment):
    """One OpenEnv session: one episode of ``environment`` at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own episode

    def __init__(self, environment: GrpoEnvironment) -> None:
        super().__init__()
        self.environment = environment
        self.episode: Episode | None = None
        self._state = State()

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        row: dict[str, Any] | None = None,
        **_: Any,
    ) -> TurnObservation:
        self.close()
        self.episode = self.environment.episode()
        self._state = State(episode_id=episode_id)
        return TurnObservation(text=self.episode.start(row or {}, 0 if seed is None else seed))

    def step(self, action: TurnAction, timeout_s: float | None = None, **_: Any) -> TurnObservation:
        if self.episode is None:
            raise RuntimeError("step before reset")
        self._state.step_count += 1
        step = self.episode.step(TurnCall(action.call))
        return TurnObservation(
            text=step.observation, output=step.output, error=step.error, done=step.done
        )

    @property
    def state(self) -> State:
        reward = None if self.episode is None else self.episode.reward()
        return State(**self._state.model_dump(), reward=reward)

    def close(self) -> None:
        if self.episode is not None:
            episode, self.episode = self.episode, None
            episode.close()


def app_for(environment: GrpoEnvironment, sessions: int) -> Any:
    """The FastAPI app serving ``environment``, ``sessions`` episodes at once at most."""
    app = create_app(
        lambda: EpisodeSession(environment),
        TurnAction,
        TurnObservation,
        max_concurrent_envs=sessions,
    )

    @app.get("/grpo/environment")
    def describe() -> dict[str, Any]:
        return {
            "name": environment.name,
            "tools": environment.tools,
            "stop": environment.stop,
            "has_reward": environment.has_reward,
        }

    @app.post("/grpo/action")
    def read_action(body: dict[str, Any]) -> dict[str, Any]:
        action = environment.action(str(body.get("text", "")))
        return {"action": None if action is None else {"call": action.call, "error": action.error}}

    return app


def serve(environment: GrpoEnvironment, host: str, port: int, sessions: int) -> None:
    """Serve ``environment`` until interrupted."""
    import uvicorn

    uvicorn.run(app_for(environment, sessions), host=host, port=port, log_level="warning")
