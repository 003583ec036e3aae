"""A rollout engine in another process, possibly on another machine: ``grpo serve MODEL``
holds an engine (``hf``, or ``vllm`` on its own GPUs) behind HTTP; a run with
``rollout.engine: server`` is its client (``ServerEngine``), as TRL's ``vllm_mode="server"``.

- ``POST /generate``: prompts, group size, seeds, temperature, greedy (JSON) -> the engine's
  ``Rollout`` without its rows (``torch.save`` bytes; the client puts its rows back).
- ``GET /health``: the model, the engine, the weights' version, the decoding controls the
  server was started with and its tokenizer's fingerprint. The client compares controls and
  fingerprint with its own before the first request and refuses a difference in one line: the
  trainer scores under the controls it asked for, and reads the server's token ids with its own
  vocabulary.
- Weights: ``POST /weights/init`` makes the server join a two-process gloo group on the
  client's ``TCPStore`` (``grpo.runtime.weight_sync``) and check the names and shapes the
  client will send (the policy's merged weights: full, or a LoRA policy's base plus its
  deltas); each ``POST /weights/update`` then receives one flat float32 buffer over that group,
  loads it and hands it to the engine (vLLM reloads its weights and drops its prefix cache).

A server that stops answering fails the request after ``rollout.server_timeout_s``
(``ServerLost``): the run stops with a checkpoint and one line, never a hang.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from grpo.config import Config, RolloutConfig
from grpo.rollout import RolloutLost
from grpo.runtime import weight_sync
from grpo.runtime.precision import bf16_autocast
from grpo.scoring.distribution import Decoding
from grpo.step_data import Rollout

# the controls that shape what is sampled: client and server must agree on every one
# (the temperature comes with each request: a schedule changes it)
DECODING_KEYS = (
    "max_new_tokens",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "generation_kwargs",
    "pack_float32",  # float32 products' rounding: the same tokens only under the same choice
)
TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated")
OPTIONAL_TENSORS = ("sampler_logp", "sampled_mask")


class ServerLost(RolloutLost):
    """The rollout server failed or stopped answering."""


# ------------------------------------------------------------------------- the wire format


def encode_rollout(rollout: Rollout) -> bytes:
    """A rollout without its rows, as ``torch.save`` bytes (tensors, strings, numbers only)."""
    state: dict[str, Any] = {name: getattr(rollout, name) for name in TENSORS + OPTIONAL_TENSORS}
    state |= {
        "prompts": rollout.prompts,
        "completions": rollout.completions,
        "group_size": rollout.group_size,
        "sampling": asdict(rollout.decoding),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def decode_rollout(data: bytes, rows: list[dict[str, Any]]) -> Rollout:
    state = torch.load(io.BytesIO(data), weights_only=True)
    return Rollout(
        **{name: state[name] for name in TENSORS + OPTIONAL_TENSORS},
        prompts=state["prompts"],
        completions=state["completions"],
        rows=rows,
        group_size=state["group_size"],
        decoding=Decoding(**state["sampling"]),
    )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What must agree for a server's token ids to be the client's tokens: the vocabulary
    (every token and its id, hashed) and the end and padding ids."""
    # by id, then token: get_vocab's order differs from process to process
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return {
        "vocab_size": len(vocab),
        "vocab_sha256": hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16],
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def pushed_weights(model: nn.Module) -> dict[str, Tensor]:
    """What a push carries: the weights the engine samples from, under plain HF names."""
    from grpo.rollout.vllm import merged_weights  # no vllm import: only the merge

    return merged_weights(model)


# ------------------------------------------------------------------------- the server


class Served:
    """The server's state: its engine, model and the weights group (once a client joined)."""

    def __init__(self, config: Config, engine: Any, model: nn.Module, device: torch.device) -> None:
        self.config, self.engine, self.model, self.device = config, engine, model, device
        self.version = 0  # pushes since the client's /weights/init
        self.session = ""  # the client whose weights it holds ("" : its own, as loaded)
        self.receiver: tuple[Any, list[Tensor]] | None = None
        self.tokenizer = tokenizer_fingerprint(engine.tokenizer)

    def health(self) -> dict[str, Any]:
        rollout = self.config.rollout
        return {
            "model": self.config.model.name,
            "engine": rollout.engine,
            "version": self.version,
            "session": self.session,
            "sampling": {key: getattr(rollout, key) for key in DECODING_KEYS},
            "tokenizer": self.tokenizer,
        }

    def generate(self, request: dict[str, Any]) -> bytes:
        self._holds(request)
        prompts = request["prompts"]
        autocast = bf16_autocast(self.device, self.config.model.autocast)
        with torch.no_grad(), autocast:  # the precision a run's own engine samples in
            rollout = self.engine.generate(
                prompts,
                [{} for _ in prompts],
                request["group_size"],
                seeds=request.get("seeds"),
                temperature=request.get("temperature"),
                greedy=request.get("greedy", False),
            )
        return encode_rollout(rollout)

    def init_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        own = dict(self.model.state_dict())
        params = []
        for name, shape in request["names"]:
            if name not in own or list(own[name].shape) != shape:
                raise ValueError(f"the client's weight {name} {shape} is not in the served model")
            params.append(own[name])
        # a served model with more (another depth) would sample with weights never pushed
        pushed = {name for name, _ in request["names"]}
        missing = [name for name, _ in self.model.named_parameters() if name not in pushed]
        if missing:
            raise ValueError(
                f"the served model's weight {missing[0]} (and {len(missing) - 1} more) is not "
                "among the client's: another model"
            )
        timeout = float(request["timeout_s"])
        rendezvous = weight_sync.store(request["host"], request["port"], False, timeout)
        pg = weight_sync.group(rendezvous, weight_sync.PRODUCER, timeout)
        self.receiver = (pg, params)
        self.session, self.version = secrets.token_hex(8), 0
        return {"session": self.session}

    def _holds(self, request: dict[str, Any]) -> None:
        """The weights a request was made for are the ones held: the same client's, after as
        many pushes as it made (another run may have taken this server since)."""
        held = (self.session, self.version)
        if (request.get("session"), request.get("version")) != held:
            raise ValueError(
                f"this server holds other weights (session {self.session or 'none'}, push "
                f"{self.version}) than the request's: another run pushes its weights here"
            )

    def update_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.receiver is None:
            raise ValueError("no weights group: POST /weights/init first")
        self._holds(request)
        pg, params = self.receiver
        flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
        weight_sync.broadcast(pg, flat)
        weight_sync.unflatten_into(flat, params)
        self.engine.sync_weights(self.model)
        self.version += 1
        return {"version": self.version}


def handler_for(served: Served) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # one request at a time: a client that connects and sends nothing may hold the server
        # this long, not for ever
        timeout = 30

        def _reply(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, value: Any) -> None:
            self._reply(status, json.dumps(value).encode(), "application/json")

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, served.health())
            else:
                self._json(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(request, dict):
                    raise ValueError("the request's body is not a JSON object")
                if self.path == "/generate":
                    self._reply(200, served.generate(request), "application/octet-stream")
                elif self.path == "/weights/init":
                    self._json(200, served.init_weights(request))
                elif self.path == "/weights/update":
                    self._json(200, served.update_weights(request))
                else:
                    self._json(404, {"error": f"no {self.path}"})
            except Exception as err:  # one line here, and the client stops with it
                said = f"{type(err).__name__}: {' '.join(str(err).split())}"
                print(f"grpo serve: {self.path} failed: {said}", file=sys.stderr, flush=True)
                self._json(500, {"error": said})

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would bury the server's own lines

    return Handler


def serve(
    config: Config, engine: Any, model: nn.Module, device: torch.device, host: str, port: int
) -> None:
    """Answer for ``engine`` (over ``model``, built by ``grpo serve``) until killed."""
    served = Served(config, engine, model, device)
    # one request at a time, on this thread: the engine runs where it was built (vLLM's CPU
    # attention checks its thread count against the building thread's)
    server = HTTPServer((host, port), handler_for(served))
    print(
        f"grpo serve: {config.model.name} on the {config.rollout.engine} engine at "
        f"http://{host}:{server.server_address[1]}",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()


# ------------------------------------------------------------------------- the client


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    return "; ".join(
        f"{k} {theirs.get(k)!r} -> {v!r}" for k, v in ours.items() if theirs.get(k) != v
    )


class ServerEngine:
    """``rollout.engine: server``: generation by a ``grpo serve`` process at
    ``rollout.server_url``; weights pushed to it after every optimizer step."""

    def __init__(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig
    ) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.url = config.server_url.rstrip("/")
        self.model = model  # pushed before the first request: the server holds no other's
        self.checked = False
        self.sender: tuple[Any, list[str]] | None = None
        self.weights_session, self.pushes = "", 0
        self.rendezvous: Any = None

    def _call(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.config.server_timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as err:
            try:
                said = json.loads(err.read() or b"{}").get("error", str(err))
            except (ValueError, AttributeError):  # not grpo serve's JSON error
                said = str(err)
            raise ServerLost(f"the rollout server at {self.url} failed {path}: {said}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ServerLost(
                f"the rollout server at {self.url} did not answer {path} "
                f"(rollout.server_timeout_s {self.config.server_timeout_s:g}): {reason}"
            ) from None

    def _answer(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``path``'s JSON answer; one that is not grpo serve's (another server on that port)
        is one line."""
        try:
            answer = json.loads(self._call(path, body))
            if isinstance(answer, dict):
                return answer
        except ValueError:
            pass
        raise ServerLost(
            f"the rollout server at {self.url} answered {path} with something other than "
            "grpo serve's JSON: is rollout.server_url a grpo serve?"
        )

    def _field(self, answer: dict[str, Any], key: str, path: str) -> Any:
        if key not in answer:
            raise ServerLost(
                f"the rollout server at {self.url} answered {path} without '{key}': is "
                "rollout.server_url a grpo serve?"
            )
        return answer[key]

    def _check(self) -> None:
        """Before the first request: the server samples as this run would and its token ids
        are this run's tokens, or one line."""
        health = self._answer("/health")
        theirs = self._field(health, "sampling", "/health")
        # first: an older grpo serve also lacks sampling keys added since, which would read as
        # a server started with other settings
        if "tokenizer" not in health:
            raise ServerLost(
                f"the rollout server at {self.url} does not say which tokenizer it holds: a "
                "grpo serve older than this run's grpo? start it from the same version"
            )
        if not isinstance(theirs, dict) or not isinstance(health["tokenizer"], dict):
            raise ServerLost(
                f"the rollout server at {self.url} answered /health with fields that are not "
                "grpo serve's: is rollout.server_url a grpo serve?"
            )
        ours = {key: getattr(self.config, key) for key in DECODING_KEYS}
        if differ := _differences(theirs, ours):
            raise ServerLost(
                f"the rollout server at {self.url} samples otherwise than this run "
                f"({differ}): start it with the same rollout.* settings"
            )
        theirs = health["tokenizer"]
        if differ := _differences(theirs, tokenizer_fingerprint(self.tokenizer)):
            raise ServerLost(
                f"the rollout server at {self.url} has another tokenizer than this run's "
                f"({differ}): its token ids would be read as other tokens; serve the run's "
                "model with its tokenizer"
            )
        self.checked = True

    def generate(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int] | None = None,
        temperature: float | None = None,
        greedy: bool = False,
    ) -> Rollout:
        if not self.checked:
            self._check()
        if self.sender is None:
            self.sync_weights(self.model)
        body = {
            "session": self.weights_session,
            "version": self.pushes,
            "prompts": prompts,
            "group_size": group_size,
            "seeds": seeds,
            "temperature": temperature,
            "greedy": greedy,
        }
        data = self._call("/generate", body)
        try:
            rollout = decode_rollout(data, rows)
        except Exception as err:  # torch.load of something else, or a state without a field
            raise ServerLost(
                f"the rollout server at {self.url} answered /generate with no rollout "
                f"({type(err).__name__}: {' '.join(str(err).split())[:200]}): is "
                "rollout.server_url a grpo serve of this grpo version?"
            ) from err
        if rollout.num_completions != len(prompts) * group_size:
            raise ServerLost(f"the rollout server at {self.url} answered another request")
        return rollout

    def sync_weights(self, model: nn.Module) -> None:
        weights = pushed_weights(model)
        if self.sender is None:
            timeout = self.config.server_timeout_s
            rendezvous = weight_sync.store(self.config.server_weights_host, 0, True, timeout)
            names = [[name, list(t.shape)] for name, t in weights.items()]
            init = {
                "host": self.config.server_weights_host,
                "port": rendezvous.port,
                "timeout_s": timeout,
                "names": names,
            }
            # the server joins the group while answering; this process joins it meanwhile, on
            # a thread, so that a server that refuses (another model) is said at once rather
            # than after the group's timeout
            joined: list[Any] = []
            thread = threading.Thread(
                target=self._join_into, args=(rendezvous, timeout, joined), daemon=True
            )
            thread.start()
            answer = self._answer("/weights/init", init)
            thread.join(timeout)
            if not joined or isinstance(joined[0], BaseException):
                said = joined[0] if joined else "no answer"
                raise ServerLost(
                    f"the rollout server at {self.url} did not join the weights group at "
                    f"{self.config.server_weights_host} (rollout.server_weights_host): {said}"
                )
            self.weights_session = str(self._field(answer, "session", "/weights/init"))
            self.sender = (joined[0], list(weights))
            self.rendezvous = rendezvous  # the store this process hosts: alive while it pushes
        else:  # refused here, before the broadcast would wait for a server that took another run
            self._still_ours()
        pg, names = self.sender
        flat = weight_sync.flatten([weights[name] for name in names])
        replies = []
        update = {"session": self.weights_session, "version": self.pushes}
        thread = threading.Thread(
            target=self._post_into, args=("/weights/update", update, replies), daemon=True
        )
        thread.start()
        try:
            weight_sync.broadcast(pg, flat)
        except Exception as err:
            thread.join(1)
            self._raise_from(replies)  # the server's own reason, when it refused the push
            raise ServerLost(
                f"the rollout server at {self.url} stopped taking weights: {err}"
            ) from None
        thread.join()
        self._raise_from(replies)
        self.pushes += 1

    def _still_ours(self) -> None:
        health = self._answer("/health")
        if (health.get("session"), health.get("version")) != (self.weights_session, self.pushes):
            raise ServerLost(
                f"the rollout server at {self.url} holds another run's weights now (session "
                f"{health.get('session')}, not this run's {self.weights_session}): one server per run"
            )

    @staticmethod
    def _join_into(rendezvous: Any, timeout: float, out: list) -> None:
        try:
            out.append(weight_sync.group(rendezvous, weight_sync.TRAINER, timeout))
        except BaseException as err:
            out.append(err)

    def _post_into(self, path: str, body: dict[str, Any], out: list) -> None:
        try:
            out.append(self._call(path, body))
        except BaseException as err:
            out.append(err)

    @staticmethod
    def _raise_from(replies: list) -> None:
        if replies and isinstance(replies[0], BaseException):
            raise replies[0]
