"""OpenEnv servers as environments: ``rollout.environment: openenv+http://HOST:PORT``.

Each completion is one OpenEnv session, through ``openenv-core``'s own client
(``GenericEnvClient``: a WebSocket per session, since OpenEnv's plain HTTP ``/reset`` and
``/step`` each make a fresh environment): ``start`` resets it with the prompt's seed and the
dataset row's columns (a server's ``reset`` takes the keywords its signature names), and its
observation text joins the prompt; each model turn is one ``step``; the observation text is the
next message; ``done`` ends the completion; the session closes at the end.

A server that ``grpo env-serve`` started gets the row whole (``reset(seed, row=...)``); any
other server gets the columns as keywords, the prompt's seed taking the place of a ``seed``
column.

How a turn becomes an action, and what else is read, is set in the URL's query
(``openenv+http://127.0.0.1:8000?action=tool&reward=last``):

- ``action=text`` (default): the turn's text is the action's ``field`` (default: the action's
  one string field in the server's ``/schema``); every turn is a step.
- ``action=tool``: the action is offered to the model as one tool (named after the server's
  environment, its parameters the action's fields), called in the chat template's syntax
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``); its arguments are the action.
  A turn without a call is the answer: it ends the completion.
- ``observation``: the observation field shown to the model (default: its one string field;
  else the observation's fields as JSON).
- ``reward=sum`` (default) or ``last``: the step rewards' sum, or the last one, is the episode's
  reward (the ``environment`` reward function). None when no step gave one.

A server that ``grpo env-serve`` started (``serve``) describes itself at ``/grpo/environment``:
then the environment's own tools, stop strings, action parsing and reward are used, so a class
served this way runs as it does in process.

Failures: a server that is not there, or answers something other than OpenEnv, at start: one
line (``ConfigError``). Later, an environment that raises in a step or rejects an action's fields
answers an error observation (shown to the model, counted). A connection lost, a server that
stops answering within ``timeout_s``, or one that refuses a session: ``EnvironmentFailure``, one
line naming the server (the run stops with its last checkpoint). Connecting is retried
(``RETRIES`` times); a step is not (the server's session may have moved).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from grpo.config import ConfigError
from grpo.environments import Action, EnvironmentFailure, Step, ending_tool_call
from grpo.environments.event_loop import EventLoop
from grpo.runtime.user_code import one_line

SCHEME = "openenv+"
RETRIES = 3  # attempts at opening a session (the first included)
BACKOFF_S = 0.5  # doubled after each failed attempt
WAIT_FRAC = 0.9  # of rollout.environment_timeout_s: a session's limit on one answer
ACTIONS = ("text", "tool")
REWARDS = ("sum", "last")
OBSERVATION_KEYS = {"done", "reward", "metadata"}  # not the observation's text


def is_openenv(spec: str) -> bool:
    """Whether a ``rollout.environment`` value names an OpenEnv server."""
    return spec.startswith(SCHEME)


@dataclass(frozen=True)
class Address:
    """Where the server is and how its actions and observations are read (the URL's query)."""

    url: str
    action: str = "text"
    field: str | None = None
    observation: str | None = None
    reward: str = "sum"


def parse_address(spec: str) -> Address:
    """``openenv+http://HOST:PORT?key=value&...`` as an ``Address``; ``ConfigError`` naming
    ``rollout.environment`` for anything else."""
    parts = urllib.parse.urlsplit(spec.removeprefix(SCHEME))
    if not is_openenv(spec) or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"rollout.environment: '{spec}' is not openenv+http://HOST:PORT")
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    known = {"action", "field", "observation", "reward"}
    if unknown := sorted(set(query) - known):
        raise ConfigError(
            f"rollout.environment: unknown option {unknown[0]!r} in '{spec}' "
            f"(options: {', '.join(sorted(known))})"
        )
    address = Address(parts._replace(query="", fragment="").geturl().rstrip("/"), **query)
    for key, allowed in (("action", ACTIONS), ("reward", REWARDS)):
        if getattr(address, key) not in allowed:
            raise ConfigError(
                f"rollout.environment: {key}={getattr(address, key)} in '{spec}' "
                f"(one of: {', '.join(allowed)})"
            )
    return address


def get_json(url: str, timeout_s: float) -> Any:
    """The JSON a GET of ``url`` answers (``OSError`` or ``ValueError`` when it does not)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def post_json(url: str, body: Any, timeout_s: float) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def string_fields(schema: dict[str, Any], skip: set[str]) -> tuple[list[str], list[str]]:
    """A JSON schema's property names (less ``skip``) and those of them typed string."""
    properties = {k: v for k, v in schema.get("properties", {}).items() if k not in skip}
    return list(properties), [k for k, v in properties.items() if v.get("type") == "string"]


def tool_call(text: str, name: str) -> Action | None:
    """The ``<tool_call>{...}</tool_call>`` that ends ``text``, as an action (its error when
    it names another tool or is not JSON); None for a turn without one."""
    found = ending_tool_call(text)
    if found is None:
        return None
    called, arguments = found
    if called is None:
        return Action(None, f'a tool call is {{"name": "{name}", "arguments": {{...}}}}')
    call = {"name": called, "arguments": arguments}
    if called != name or not isinstance(arguments, dict):
        return Action(call, f"unknown tool '{called}' (tools: {name})")
    return Action(call)


class OpenEnvEnvironment:
    """An OpenEnv server, one session per completion (see the module docstring)."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        self.spec = spec
        self.address = parse_address(spec)
        self.timeout_s = timeout_s
        # a session gives up before the loop abandons its call: a silent server stops the run
        # (a call abandoned mid-message would leave the session reading a stale answer)
        self.wait_s = WAIT_FRAC * timeout_s
        try:
            import openenv.core  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"rollout.environment: {spec} needs openenv-core (pip install 'grpo[envs]')"
            ) from None
        url = self.address.url
        try:
            get_json(f"{url}/health", timeout_s)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"rollout.environment: no OpenEnv server answers at {url} ({err})"
            ) from None
        try:
            schema = get_json(f"{url}/schema", timeout_s)
            action_schema, observation_schema = schema["action"], schema["observation"]
            self.env_name = get_json(f"{url}/metadata", timeout_s).get("name", "environment")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                f"rollout.environment: {url} answers, but not as an OpenEnv server "
                f"(GET /schema, /metadata: {err})"
            ) from None
        self.served = self._served()
        self.name = f"openenv {url}"
        self.action_fields, strings = string_fields(action_schema, {"metadata"})
        self.field = self.address.field or (strings[0] if len(strings) == 1 else None)
        if self.address.action == "text" and self.served is None and self.field is None:
            raise ConfigError(
                f"rollout.environment: {url}'s action has no single string field to hold a "
                f"turn's text (fields: {', '.join(self.action_fields)}); name one with "
                "?field=NAME, or use ?action=tool"
            )
        if self.field is not None and self.field not in self.action_fields:
            raise ConfigError(
                f"rollout.environment: field={self.field}: {url}'s action has the fields "
                f"{', '.join(self.action_fields)}"
            )
        observed, strings = string_fields(observation_schema, OBSERVATION_KEYS)
        self.observation = self.address.observation or (strings[0] if len(strings) == 1 else None)
        if self.observation is not None and self.observation not in observed:
            raise ConfigError(
                f"rollout.environment: observation={self.observation}: {url}'s observation has "
                f"the fields {', '.join(observed)}"
            )
        parameters = {k: v for k, v in action_schema.items() if k in ("properties", "required")}
        parameters["properties"] = {
            k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"
        }
        self.tool_schema = {
            "type": "function",
            "function": {
                "name": self.env_name,
                "description": f"Act in the {self.env_name} environment.",
                "parameters": {"type": "object", **parameters},
            },
        }
        self.events = EventLoop()

    def close(self) -> None:
        """The run is over: the sessions' loop ends (each session closed its own)."""
        self.events.close()

    def _served(self) -> dict[str, Any] | None:
        """What a server ``serve`` started says of itself; None for any other server."""
        try:
            return get_json(f"{self.address.url}/grpo/environment", self.timeout_s)
        except urllib.error.HTTPError:
            return None
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"rollout.environment: {self.address.url} stopped answering ({err})"
            ) from None

    @property
    def has_reward(self) -> bool:
        """A served environment's own answer; any other server's steps may carry rewards."""
        return True if self.served is None else self.served["has_reward"]

    @property
    def tools(self) -> list[dict[str, Any]]:
        if self.served is not None:
            return self.served["tools"]
        return [self.tool_schema] if self.address.action == "tool" else []

    @property
    def stop(self) -> list[str]:
        if self.served is not None:
            return self.served["stop"]
        return ["</tool_call>"] if self.address.action == "tool" else []

    def action(self, text: str) -> Action | None:
        if self.served is not None:  # the served environment reads its own actions
            answer = self.request("action", {"text": text})["action"]
            return None if answer is None else Action(answer["call"], answer["error"])
        if self.address.action == "tool":
            return tool_call(text, self.env_name)
        return Action(text)

    def request(self, path: str, body: Any) -> Any:
        try:
            return post_json(f"{self.address.url}/grpo/{path}", body, self.timeout_s)
        except (OSError, ValueError) as err:
            raise EnvironmentFailure(f"{self.name}: POST /grpo/{path} failed ({err})") from None

    def payload(self, action: Action) -> dict[str, Any]:
        """The step's action fields."""
        if self.served is not None:
            return {"call": action.call}
        if self.address.action == "tool":
            return action.call["arguments"]
        return {self.field: action.call}

    def text(self, observation: dict[str, Any]) -> str:
        """An observation's text for the model."""
        if self.observation is not None:
            value = observation.get(self.observation)
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps(observation)

    def episode(self) -> OpenEnvEpisode:
        return OpenEnvEpisode(self)

    def why_no_session(self, err: BaseException) -> str:
        """Why sessions fail (``err``: the last attempt's error), as far as the server says."""
        try:
            get_json(f"{self.address.url}/health", self.wait_s)
        except (OSError, ValueError):
            return "the server is gone"
        said = str(err)
        # openenv-core's server says a full house either by closing the socket or in an error
        # message of its own (code CAPACITY_REACHED), whichever comes first
        if said.startswith("Server error") and "CAPACITY_REACHED" not in said:
            return "the server's environment failed to reset"
        return (
            "the server answers but refuses sessions: it holds at most its max_concurrent_envs "
            "at once, and a rollout holds one per completion"
        )


class OpenEnvEpisode:
    """One session of an ``OpenEnvEnvironment``."""

    instance = None  # the environment lives in the server's process: nothing to hand rewards

    def __init__(self, environment: OpenEnvEnvironment) -> None:
        self.env = environment
        self.client: Any = None
        self.rewards: list[float] = []
        self.lost: str | None = None  # why the session cannot go on

    def _run(self, work: Coroutine, doing: str) -> Any:
        """``work`` on the environment's loop; a lost or silent server fails in one line, and
        the session is not used again."""
        if self.lost is not None:
            work.close()
            raise EnvironmentFailure(self.lost)
        try:
            return self.env.events.run(work, self.env.wait_s)
        except TimeoutError:
            self.lost = (
                f"{self.env.name}: no answer to {doing} in {self.env.wait_s:g} s "
                f"(rollout.environment_timeout_s: {self.env.timeout_s:g})"
            )
        except lost_errors() as err:
            self.lost = f"{self.env.name}: {doing} failed ({one_line(err)})"
        raise EnvironmentFailure(self.lost)

    def start(self, row: dict[str, Any], seed: int) -> str | None:
        from openenv.core import GenericEnvClient

        columns = json.loads(json.dumps(row, default=str))
        for attempt in range(RETRIES):
            self.client = GenericEnvClient(
                base_url=self.env.address.url,
                connect_timeout_s=self.env.wait_s,
                message_timeout_s=self.env.wait_s,
            )
            self.lost = None
            try:
                # a served environment gets the row whole (a column may be called "seed");
                # another server's reset takes the columns its signature names
                given = {"row": columns} if self.env.served is not None else columns
                result = self._run(self.client.reset(**{**given, "seed": seed}), "reset")
                break
            except (EnvironmentFailure, RuntimeError) as err:
                self.close()
                if attempt + 1 == RETRIES:
                    raise EnvironmentFailure(
                        f"{self.env.name}: no session after {RETRIES} attempts "
                        f"({one_line(err)}); {self.env.why_no_session(err)}"
                    ) from None
                time.sleep(BACKOFF_S * 2**attempt)
        if self.env.served is not None:
            return result.observation.get("text")
        text = self.env.text(result.observation)
        return text or None

    def step(self, action: Action) -> Step:
        try:
            result = self._run(self.client.step(self.env.payload(action)), "a step")
        except EnvironmentFailure:
            raise
        except RuntimeError as err:  # the server's answer to a failing step: shown, counted
            said = str(err).removeprefix("Server error: ")
            return Step(f"Error: {said}", "", said)
        observation = result.observation
        if self.env.served is not None:
            return Step(
                observation["text"], observation["output"], observation["error"], result.done
            )
        if result.reward is not None:
            self.rewards.append(float(result.reward))
        return Step(self.env.text(observation), done=result.done)

    def reward(self) -> float | None:
        if self.env.served is not None:
            return self._run(self.client.state(), "state").get("reward")
        if not self.rewards:
            return None
        return sum(self.rewards) if self.env.address.reward == "sum" else self.rewards[-1]

    def close(self) -> None:
        if self.client is None or self.lost is not None:  # a lost session: the run stops
            return
        client, self.client = self.client, None
        # the session is over either way: a server that does not answer reaps it itself
        with contextlib.suppress(TimeoutError, RuntimeError, *lost_errors()):
            self.env.events.run(closed(client), self.env.wait_s)


def lost_errors() -> tuple[type[BaseException], ...]:
    """What a lost connection raises: the socket's errors and the websockets client's."""
    from websockets.exceptions import WebSocketException

    return (OSError, WebSocketException)


async def closed(client: Any) -> None:
    """Close a session and wait for the server to close its side first (closing ours at once
    races the server's own close, which it then logs as an error)."""
    if client._ws is not None:
        await client._send({"type": "close"})
        await client._ws.wait_closed()
    await client.close()
