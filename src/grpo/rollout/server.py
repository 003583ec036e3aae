"""A rollout engine in another process, possibly on another machine: ``grpo serve MODEL``
holds an engine (``hf``, or ``vllm`` on its own GPUs) behind HTTP; a run with
``rollout.engine: server`` is its client (``ServerEngine``), as TRL's ``vllm_mode="server"``.

- ``POST /generate``: prompts, group size, seeds, temperature, greedy (JSON) -> the engine's
  ``Rollout`` without its rows (``torch.save`` bytes; the client puts its rows back).
- ``GET /info``: the model, the engine, the weights' session and version, the decoding
  controls the server was started with and its tokenizer's fingerprint. The client compares
  controls and fingerprint with its own before the first request and refuses a difference in one
  line: the trainer scores under the controls it asked for, and reads the server's token ids with
  its own vocabulary. (``GET /health`` answers liveness only, to anyone.)
- Weights: ``POST /weights/init`` makes the server join a two-process gloo group on the
  client's ``TCPStore`` (``grpo.runtime.weight_sync``) and check the names and shapes the
  client will send (the policy's merged weights: full, or a LoRA policy's base plus its
  deltas); each ``POST /weights/update`` then receives one flat float32 buffer over that group,
  loads it and hands it to the engine (vLLM reloads its weights and drops its prefix cache).

Every request but ``/health`` carries the server's token (``Authorization: Bearer``:
``rollout.server_token``, else ``GRPO_SERVE_TOKEN``). The server's side is
``grpo.rollout.server_http``. A server that stops answering fails the request after
``rollout.server_timeout_s`` (``ServerLost``): the run stops with a checkpoint and one line,
never a hang.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from grpo.config import ConfigError, RolloutConfig
from grpo.rollout import RolloutLost
from grpo.rollout.listener import TOKEN_ENV
from grpo.runtime import weight_sync
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
    "compile",  # a compiled decode step's rounding: the same
)
TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated")
OPTIONAL_TENSORS = ("sampler_logp", "sampled_mask")


def no_answer_cause(err: BaseException, timeout_s: float) -> str:
    """Why a request got no answer, in words (not the socket library's "[Errno 111] ...")."""
    reason = getattr(err, "reason", err)  # URLError wraps the socket's error
    if isinstance(reason, TimeoutError):
        return f"nothing came back within rollout.server_timeout_s ({timeout_s:g} s)"
    if isinstance(reason, ConnectionRefusedError):
        return "nothing listens there (the server exited, or was never started on that port)"
    # http.client.RemoteDisconnected (closed before a status line) is a ConnectionResetError
    if isinstance(reason, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return "it closed the connection mid-request (the server exited or was killed)"
    if isinstance(reason, socket.gaierror):
        return "its host name does not resolve"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[0].lower() + reason.strerror[1:]
    return str(reason) or type(reason).__name__


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
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"rollout.server_url {config.server_url!r} is not a server's address "
                "(http://HOST:PORT, where grpo serve answers)"
            )
        self.token = config.server_token or os.environ.get(TOKEN_ENV, "")
        self.model = model  # pushed before the first request: the server holds no other's
        self.checked = False
        self.sender: tuple[Any, list[str]] | None = None
        self.weights_session, self.pushes = "", 0
        self.rendezvous: Any = None

    def _call(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.config.server_timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as err:
            try:
                said = json.loads(err.read() or b"{}").get("error", str(err))
            except (ValueError, AttributeError):  # not grpo serve's JSON error
                said = str(err)
            if err.code == 404 and path == "/info":
                said += ": a grpo serve older than this run's grpo? start it from the same version"
            raise ServerLost(f"the rollout server at {self.url} failed {path}: {said}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            raise ServerLost(
                f"the rollout server at {self.url} did not answer {path}: "
                f"{no_answer_cause(err, self.config.server_timeout_s)}"
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
        info = self._answer("/info")
        theirs = self._field(info, "sampling", "/info")
        # first: an older grpo serve also lacks sampling keys added since, which would read as
        # a server started with other settings
        if "tokenizer" not in info:
            raise ServerLost(
                f"the rollout server at {self.url} does not say which tokenizer it holds: a "
                "grpo serve older than this run's grpo? start it from the same version"
            )
        if not isinstance(theirs, dict) or not isinstance(info["tokenizer"], dict):
            raise ServerLost(
                f"the rollout server at {self.url} answered /info with fields that are not "
                "grpo serve's: is rollout.server_url a grpo serve?"
            )
        ours = {key: getattr(self.config, key) for key in DECODING_KEYS}
        if differ := _differences(theirs, ours):
            raise ServerLost(
                f"the rollout server at {self.url} samples otherwise than this run "
                f"({differ}): start it with the same rollout.* settings"
            )
        theirs = info["tokenizer"]
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
            secret = weight_sync.new_secret()
            names = [[name, list(t.shape)] for name, t in weights.items()]
            init = {
                "host": self.config.server_weights_host,
                "port": rendezvous.port,
                "timeout_s": timeout,
                "names": names,
                "secret": secret.hex(),
            }
            # the server joins the group while answering; this process joins it meanwhile, on
            # a thread, so that a server that refuses (another model) is said at once rather
            # than after the group's timeout
            joined: list[Any] = []
            thread = threading.Thread(
                target=self._join_into, args=(rendezvous, timeout, secret, joined), daemon=True
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
        except Exception:  # gloo's words name a socket, not the side: ours say which
            thread.join(1)
            self._raise_from(replies)  # the server's own reason, when it refused the push
            raise ServerLost(
                f"the rollout server at {self.url} stopped taking weights (their connection "
                f"broke or waited rollout.server_timeout_s {self.config.server_timeout_s:g})"
            ) from None
        thread.join()
        self._raise_from(replies)
        self.pushes += 1

    def _still_ours(self) -> None:
        info = self._answer("/info")
        if (info.get("session"), info.get("version")) != (self.weights_session, self.pushes):
            raise ServerLost(
                f"the rollout server at {self.url} holds another run's weights now (session "
                f"{info.get('session')}, not this run's {self.weights_session}): one server per run"
            )

    @staticmethod
    def _join_into(rendezvous: Any, timeout: float, secret: bytes, out: list) -> None:
        try:
            out.append(weight_sync.group(rendezvous, weight_sync.TRAINER, timeout, secret))
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
