"""verifiers harnesses as environments: ``rollout.environment: verifiers+HARNESS``, on rows of a
verifiers taskset (``data.task: verifiers``, ``grpo.data.verifiers``).

A verifiers harness drives its episode itself: it calls a model through an OpenAI-compatible
client. Here each completion is one run of verifiers' own ``Agent`` (the harness, its
interception server, the task's scoring), whose model is the policy being trained, served on a
loopback endpoint (``PolicyEndpoint``: ``/v1/chat/completions``, a bearer token of its own, one
model name per episode). The turn loop stays the one that samples: a harness's model call waits
at the endpoint until the loop has sampled that turn, and is answered with the turn's text:

- ``start``: the Agent starts on the row's task; its first model call must carry the row's
  prompt (the task's messages), which the loop renders and samples from;
- ``step(turn)``: the pending call is answered with the turn's text; the harness's next call
  brings the messages it added (tool results, a user's reply): their text is the observation;
  a harness that ends instead ends the completion (``done``);
- ``reward``: the trace's reward as verifiers weighs the task's rewards (``trace.reward``);
  ``instance`` is the ``vf.Trace``. A completion the loop's limits cut (``rollout.max_turns``,
  the token budget) has its harness's waiting call refused, and its trace, without the cut
  turn, is scored as it stands.

Token in, token out: the loop keeps the token ids it sampled and appends the observation's
template tokens after them; the text a harness sends back for the model's earlier turns is never
tokenised again, and the loss mask covers the sampled tokens only.

HARNESS is a verifiers harness id: a module exporting its ``vf.Harness`` subclass in ``__all__``
(verifiers' convention), one of verifiers' own or one on the path.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import queue
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from grpo.config import ConfigError
from grpo.environments import Action, EnvironmentFailure, Step

SCHEME = "verifiers+"
MAX_BODY = 16 << 20  # a chat's messages, many times over; a longer body is not read
KEY_VAR = "GRPO_POLICY_ENDPOINT_KEY"  # + _PORT: where verifiers' client reads the token


def is_verifiers(spec: str) -> bool:
    """Whether a ``rollout.environment`` value names a verifiers harness."""
    return spec.startswith(SCHEME)


class PolicyEndpoint:
    """``POST /v1/chat/completions`` on 127.0.0.1 for the episodes registered by model name;
    every request carries ``Authorization: Bearer TOKEN``."""

    def __init__(self, timeout_s: float) -> None:
        self.token = secrets.token_urlsafe(24)
        self.timeout_s = timeout_s
        self.episodes: dict[str, VerifiersEpisode] = {}
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 60  # an idle or trickling connection frees its thread

            def do_POST(self) -> None:
                status, answer = endpoint.answer(self.path, self.headers, self._body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                """The JSON body; None for one without a usable length, or not JSON."""
                length = self.headers.get("Content-Length", "")
                if not (length.isascii() and length.isdigit()) or int(length) > MAX_BODY:
                    return None
                try:
                    return json.loads(self.rfile.read(int(length)))
                except ValueError:
                    return None

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        """Stop listening (calls still waiting were answered by their episodes' close)."""
        self.server.shutdown()
        self.server.server_close()

    def answer(
        self, path: str, headers: Any, read_body: Callable[[], Any]
    ) -> tuple[int, dict[str, Any]]:
        """The status and JSON answer of one request (the body is read after the token)."""
        given = headers.get("Authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return 401, {"error": {"message": "a bearer token is needed"}}
        body = read_body()
        if path.rstrip("/") != "/v1/chat/completions" or not isinstance(body, dict):
            return 404, {"error": {"message": "POST /v1/chat/completions only"}}
        episode = self.episodes.get(str(body.get("model")))
        if episode is None:
            return 404, {"error": {"message": f"no episode {body.get('model')!r}"}}
        text = episode.model_call(body.get("messages") or [])
        if text is None:
            return 400, {"error": {"message": "the episode is over (a turn or token limit)"}}
        return 200, {
            "id": f"chatcmpl-{secrets.token_hex(8)}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


class VerifiersEnvironment:
    """Episodes of a verifiers harness on the rows' tasks (see the module docstring)."""

    has_reward = True

    def __init__(self, spec: str, timeout_s: float) -> None:
        import os

        self.tools: list[dict[str, Any]] = []  # the harness offers its tools in its requests
        self.stop: list[str] = []  # every turn answers the harness's pending call
        from grpo.environments.event_loop import EventLoop

        self.harness_id = spec.removeprefix(SCHEME)
        self.name = f"verifiers harness {self.harness_id}"
        try:
            from verifiers.v1.utils.loaders import harness_class, harness_config_type
        except ImportError:
            raise ConfigError(
                f"rollout.environment: {spec} needs verifiers (pip install 'grpo[envs]')"
            ) from None
        try:
            harness_class(self.harness_id)
            self.harness_config = harness_config_type(self.harness_id)(id=self.harness_id)
        except (ImportError, TypeError, ValueError) as err:
            raise ConfigError(
                f"rollout.environment: {spec}: no verifiers harness {self.harness_id} ({err})"
            ) from None
        # a cut episode's refused call is expected: verifiers would warn of each one
        logging.getLogger("verifiers.v1.interception").setLevel(logging.ERROR)
        self.timeout_s = timeout_s
        self.endpoint = PolicyEndpoint(timeout_s)
        # verifiers' client reads its key from a variable it is given the name of: one for each
        # endpoint (a run may build its environment more than once)
        self.key_var = f"{KEY_VAR}_{self.endpoint.server.server_address[1]}"
        os.environ[self.key_var] = self.endpoint.token
        self.events = EventLoop()
        self.count = itertools.count()

    def action(self, text: str) -> Action:
        return Action(text)

    def close(self) -> None:
        """The run is over: the Agents still running are cancelled, the endpoint stops
        listening and its token leaves the environment variables."""
        import os

        self.events.close()
        self.endpoint.close()
        os.environ.pop(self.key_var, None)

    def episode(self) -> VerifiersEpisode:
        return VerifiersEpisode(self, f"grpo-episode-{next(self.count)}")


class VerifiersEpisode:
    """One Agent run; its model calls meet the turn loop's turns (see the module docstring)."""

    def __init__(self, environment: VerifiersEnvironment, model: str) -> None:
        self.env = environment
        self.model = model
        self.calls: queue.Queue = queue.Queue()  # ("call", messages, reply slot) | ("done",)
        self.pending: queue.Queue | None = None  # the reply slot of the call waiting
        self.seen = 0  # messages of the conversation already shown
        self.instance: Any = None  # the vf.Trace, once the run is over
        self.run: Any = None
        self.task: Any = None
        self.ended = False

    def model_call(self, messages: list[dict[str, Any]]) -> str | None:
        """A harness's model call, on the endpoint's thread: wait for the loop's turn."""
        slot: queue.Queue = queue.Queue()
        self.calls.put(("call", messages, slot))
        try:
            return slot.get(timeout=self.env.timeout_s * 10)
        except queue.Empty:
            return None

    async def _play(self, task: Any) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.configs.client import EvalClientConfig
        from verifiers.v1.runtimes import SubprocessConfig

        config = vf.AgentConfig(
            model=self.model,
            harness=self.env.harness_config,
            client=EvalClientConfig(base_url=self.env.endpoint.url, api_key_var=self.env.key_var),
            runtime=SubprocessConfig(),
        )
        try:
            async with vf.Agent(config) as agent:
                self.instance = await agent.run(task)
        finally:
            self.calls.put(("done",))

    def _next(self) -> tuple:
        try:
            return self.calls.get(timeout=self.env.timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"{self.env.name}: no model call and no end within {self.env.timeout_s:g} s"
            ) from None

    def start(self, row: dict[str, Any], seed: int) -> None:
        from grpo.data.verifiers import prompt_messages, tasks

        if "verifiers_task" not in row:
            raise EnvironmentFailure(
                f"{self.env.name}: the rows are not a verifiers taskset's (data.task: verifiers)"
            )
        task = self.task = tasks(row["verifiers_taskset"])[int(row["verifiers_task"])]
        self.env.endpoint.episodes[self.model] = self
        self.run = asyncio.run_coroutine_threadsafe(self._play(task), self.env.events.loop)
        event = self._next()
        if event[0] == "done":
            raise RuntimeError(f"{self.env.name}: the harness ended before calling the model")
        _, messages, self.pending = event
        said = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
        if said != prompt_messages(task):
            raise ValueError(
                f"{self.env.name}: the harness's first call is not the task's prompt "
                f"({json.dumps(said)[:200]})"
            )
        self.seen = len(messages)
        return None

    def step(self, action: Action) -> Step:
        self.pending.put(action.call)
        self.pending = None
        event = self._next()
        if event[0] == "done":
            self.ended = True
            return Step("", "the harness ended", done=True)
        _, messages, self.pending = event
        added = messages[self.seen + 1 :]  # after the assistant message answering the last call
        self.seen = len(messages)
        return Step("\n\n".join(str(m.get("content") or "") for m in added))

    def reward(self) -> float | None:
        self._finish()
        trace = self.instance
        if trace is None:
            return None
        if not trace.rewards:  # cut by the loop's limits (its last call refused): as it stands
            work = self.task.score(trace)
            asyncio.run_coroutine_threadsafe(work, self.env.events.loop).result(self.env.timeout_s)
        return float(trace.reward) if trace.rewards else None

    def _finish(self) -> None:
        """The run's end: a call still waiting (the loop's limits ended the completion) is
        refused, and the run scored."""
        while not self.ended:
            if self.pending is not None:
                self.pending.put(None)
                self.pending = None
            event = self._next()
            if event[0] == "done":
                self.ended = True
            else:
                self.pending = event[2]

    def close(self) -> None:
        self.env.endpoint.episodes.pop(self.model, None)
        if self.pending is not None:
            self.pending.put(None)
        if self.run is not None and not self.run.done():
            self.run.cancel()
