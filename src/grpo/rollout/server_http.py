"""``grpo serve``'s side of the rollout server (the protocol and the client are in
``grpo.rollout.server``): an engine behind HTTP that only its run can drive.

- **A token on every request** but ``GET /health`` (a bare liveness answer that names no
  session and no push count): ``Authorization: Bearer TOKEN``, compared in constant time. The
  token is ``--token``, else ``GRPO_SERVE_TOKEN``, else generated and printed at start; a server
  that reaches beyond this machine (``--host`` not loopback) must be given one.
- **Weights from an allowed host only**: ``/weights/init`` joins a process group at the host the
  client names only where that host is the client's own address (as this server sees it) or one
  of ``--weights-hosts``, and the join ends within its timeout even against a port that accepts
  and never answers (torch's store waits for an answer without one: it runs on a thread this
  server abandons).
- **Bounded** (``grpo.rollout.listener``, which binds the address before torch loads):
  connections are served on up to ``HANDLERS`` threads at once (past that, the one that has
  been arriving longest is cut), each request read within ``REQUEST_S`` with pauses of at most
  ``READ_S``; a body needs its ``Content-Length``, at most ``MAX_BODY`` bytes (413 past it,
  before reading). The engine's work (a rollout, a weight push) runs one request at a time on
  the thread that built it.
- **One line per failure**: at start (exit 2, ``ConfigError``), and per request on the console.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import json
import math
import queue
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo.config import Config
from grpo.rollout.listener import (
    READ_S,
    REQUEST_S,
    TOKEN_ENV,
    Address,
    Listener,
    addresses,
    canonical,
)
from grpo.rollout.server import DECODING_KEYS, encode_rollout, tokenizer_fingerprint
from grpo.runtime import weight_sync
from grpo.runtime.precision import bf16_autocast
from grpo.runtime.user_code import one_line
from grpo.runtime.weight_sync import SECRET_BYTES

MAX_BODY = 64 << 20  # a step's prompts and a model's weight names fit many times over


def quiet_torch_logs() -> None:
    """Silence torch's C++ log (a failed rendezvous writes its retries there, each with a C++
    stack); this process says each failure in one line of its own. ``TORCH_CPP_LOG_LEVEL`` is
    read when torch loads, before any command runs, so the level is set where it lives."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level").value = 3  # FATAL only
    except (OSError, ValueError):  # another build of torch: its lines stay
        pass


def join_weights_group(address: str, port: int, timeout_s: float, secret: bytes) -> Any:
    """The server's side of the client's weights group, or ``TimeoutError`` after
    ``timeout_s``. A store that accepts and never answers holds torch's connect for ever: the
    join runs on a daemon thread, abandoned past the limit."""
    joined: list[Any] = []

    def join() -> None:
        try:
            rendezvous = weight_sync.store(address, port, False, timeout_s)
            pg = weight_sync.group(rendezvous, weight_sync.PRODUCER, timeout_s, secret)
            joined.append(pg)
        except Exception as err:
            joined.append(err)

    thread = threading.Thread(target=join, name="grpo-serve-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not joined:
        raise TimeoutError(f"no weights group at {address}:{port} within {timeout_s:g} s")
    if isinstance(joined[0], Exception):
        raise ConnectionError(
            f"no weights group at {address}:{port}: {one_line(joined[0])}"
        ) from None
    return joined[0]


# ------------------------------------------------------------------------- the engine's state


class Served:
    """The server's state: its engine, model and the weights group (once a client joined)."""

    def __init__(self, config: Config, engine: Any, model: nn.Module, device: torch.device) -> None:
        self.config, self.engine, self.model, self.device = config, engine, model, device
        self.version = 0  # pushes since the client's /weights/init
        self.session = ""  # the client whose weights it holds ("" : its own, as loaded)
        self.receiver: tuple[Any, list[Tensor]] | None = None
        self.tokenizer = tokenizer_fingerprint(engine.tokenizer)

    def info(self) -> dict[str, Any]:
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

    def init_weights(self, request: dict[str, Any], address: str) -> dict[str, Any]:
        """Join the client's weights group at ``address`` (checked by ``weights_address``)."""
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
        # the client's limit, within this server's own
        timeout = min(float(request["timeout_s"]), self.config.rollout.server_timeout_s)
        secret = bytes.fromhex(request["secret"])
        pg = join_weights_group(address, request["port"], timeout, secret)
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


def weights_address(request: dict[str, Any], client: Address, allowed: set[Address]) -> str:
    """The address to join ``/weights/init``'s group at: the named host's first address that
    is the client's own or an allowed one; ``PermissionError`` for any other host, and
    ``ValueError`` for a request that is not ``ServerEngine``'s."""
    host, port, timeout = request.get("host"), request.get("port"), request.get("timeout_s")
    if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536:
        raise ValueError("/weights/init needs a host and a port (1-65535)")
    if not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ValueError("/weights/init needs a positive timeout_s")
    if not isinstance(request.get("names"), list):
        raise ValueError("/weights/init needs the names and shapes of the weights")
    secret = request.get("secret")
    if not isinstance(secret, str) or not re.fullmatch(f"[0-9a-f]{{{2 * SECRET_BYTES}}}", secret):
        raise ValueError(f"/weights/init needs the group's secret ({SECRET_BYTES} bytes, hex)")
    try:
        named = addresses(host)
    except OSError as err:
        raise ValueError(f"the weights host {host} has no address: {err}") from None
    for ip in named:
        if ip == client or ip in allowed:
            return str(ip)  # the address checked, not the name again: it may resolve otherwise
    raise PermissionError(
        f"the weights host {host} ({', '.join(map(str, named))}) is neither the client's own "
        f"address ({client}) nor one of --weights-hosts"
    )


# ------------------------------------------------------------------------- HTTP


class EngineThread:
    """Work that must run on the thread that built the engine (vLLM's CPU attention checks its
    thread count against it), one request at a time, in the order they came."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()

    def call(self, job: Callable[[], Any]) -> Any:
        done: Future = Future()
        self.jobs.put((job, done))
        return done.result()

    def run_forever(self) -> None:
        while True:
            job, done = self.jobs.get()
            try:
                done.set_result(job())
            except Exception as err:  # said by the request's handler
                done.set_exception(err)


class Refused(Exception):
    """A request answered with ``status`` and one line, before any work."""

    def __init__(self, status: int, said: str) -> None:
        super().__init__(said)
        self.status = status


class Handler(BaseHTTPRequestHandler):
    """One connection's requests; ``handler_for`` binds the server's state, its engine's
    thread, the token and the hosts a weights group may join."""

    served: Served
    worker: EngineThread
    expected: bytes  # the token
    allowed: set[Address]
    timeout = READ_S  # each read and write on the connection

    def setup(self) -> None:
        super().setup()
        self.server.arriving(self.connection)

    def finish(self) -> None:
        self.server.arrived(self.connection)
        with contextlib.suppress(OSError):  # the client hung up
            super().finish()

    def _reply(self, status: int, body: bytes, kind: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="grpo serve"')
            self.end_headers()
            self.wfile.write(body)
        except OSError as err:  # the client hung up or stopped reading
            self.close_connection = True
            why = err.strerror or type(err).__name__  # "Broken pipe", not "[Errno 32] ..."
            self._say(
                f"{self.command} {self.path}: the answer ({status}) was not delivered ({why})"
            )

    def _json(self, status: int, value: Any) -> None:
        self._reply(status, json.dumps(value).encode(), "application/json")

    def _authorized(self) -> None:
        given = self.headers.get("Authorization")
        if given is None:
            raise Refused(
                401,
                "a token is needed: give the run grpo serve's token "
                f"(rollout.server_token or {TOKEN_ENV})",
            )
        scheme, _, value = given.partition(" ")
        # latin-1 is how http.server decoded the header: the bytes the client sent
        token = value.strip().encode("latin-1", errors="replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token, self.expected):
            raise Refused(403, "wrong token: give the run grpo serve's token")

    def _body(self) -> dict[str, Any]:
        length = (self.headers.get("Content-Length") or "").strip()
        # ASCII digits only ("²".isdigit() is True), and few enough for int()
        if not (length.isascii() and length.isdigit()) or len(length) > 18:
            raise Refused(400, "a request needs a Content-Length of 0 or more bytes")
        size = int(length)
        if size > MAX_BODY:
            raise Refused(413, f"a request of {size} bytes (at most {MAX_BODY})")
        try:
            data = self.rfile.read(size)
        except OSError:  # a pause past READ_S
            data = b""
        self.server.arrived(self.connection)
        if len(data) < size:
            raise Refused(
                408,
                f"the request's body did not arrive in full (a pause over {READ_S:g} s, or "
                f"over {REQUEST_S:g} s in all)",
            )
        try:
            request = json.loads(data or b"{}")
        except ValueError:
            raise Refused(400, "the request's body is not JSON") from None
        if not isinstance(request, dict):
            raise Refused(400, "the request's body is not a JSON object")
        return request

    def _answer(self, method: Callable[[], None]) -> None:
        try:
            method()
        except Refused as refused:
            self.close_connection = True  # an unread body must not be read as a request
            self._fail(refused.status, str(refused))
            self._discard()
        except Exception as err:  # one line here, and the client stops with it
            self._fail(500, one_line(err))

    def _discard(self) -> None:
        """Read (and drop) what a refused client still sends, for a second at most: closing
        on unread bytes resets the connection, and the client could lose the answer."""
        deadline = time.monotonic() + 1.0  # in all: a trickle cannot hold the thread longer
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)  # the answer is whole
            for _ in range(16):  # 1 MiB at most
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.connection.settimeout(left)
                if not self.connection.recv(1 << 16):
                    break

    def _say(self, what: str) -> None:
        print(f"grpo serve: {what} (from {self.client_address[0]})", file=sys.stderr, flush=True)

    def _fail(self, status: int, said: str) -> None:
        self._say(f"{self.command} {self.path} failed ({status}): {said}")
        self._json(status, {"error": said})

    def do_GET(self) -> None:
        if self.path == "/health":  # liveness only: nothing a client could replay
            self._json(200, {"status": "ok"})
        else:
            self._answer(self._get)

    def _get(self) -> None:
        self._authorized()  # before ``arrived``: a refused client stays one the server may cut
        if self.path != "/info":
            raise Refused(404, f"no {self.path}")
        self.server.arrived(self.connection)
        self._json(200, self.served.info())

    def do_POST(self) -> None:
        self._answer(self._post)

    def _post(self) -> None:
        self._authorized()
        request = self._body()
        if self.path == "/generate":
            rollout = self.worker.call(lambda: self.served.generate(request))
            self._reply(200, rollout, "application/octet-stream")
        elif self.path == "/weights/init":
            client = canonical(self.client_address[0])
            try:
                address = weights_address(request, client, self.allowed)
            except PermissionError as err:
                raise Refused(403, str(err)) from None
            except ValueError as err:
                raise Refused(400, str(err)) from None
            self._json(200, self.worker.call(lambda: self.served.init_weights(request, address)))
        elif self.path == "/weights/update":
            self._json(200, self.worker.call(lambda: self.served.update_weights(request)))
        else:
            raise Refused(404, f"no {self.path}")

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would bury the server's own lines

    def log_error(self, format: str, *args: Any) -> None:
        # what http.server refuses itself (a bad request line, too many headers, a timeout)
        self._say(f"request refused: {format % args}")


def handler_for(
    served: Served, worker: EngineThread, token: str, allowed: set[Address]
) -> type[BaseHTTPRequestHandler]:
    """The handler class of one server: ``Handler`` bound to its state."""
    bound = {"served": served, "worker": worker, "expected": token.encode(), "allowed": allowed}
    return type("BoundHandler", (Handler,), bound)


def serve(
    config: Config, engine: Any, model: nn.Module, device: torch.device, listener: Listener
) -> None:
    """Answer for ``engine`` (over ``model``, built by ``grpo serve``) until killed: HTTP on the
    listener's threads, the engine's work on this one."""
    quiet_torch_logs()
    worker = EngineThread()
    served = Served(config, engine, model, device)
    listener.RequestHandlerClass = handler_for(served, worker, listener.token, listener.allowed)
    threading.Thread(target=listener.serve_forever, name="grpo-serve-http", daemon=True).start()
    host, port = listener.server_address[:2]
    print(
        f"grpo serve: {config.model.name} on the {config.rollout.engine} engine at "
        f"http://{host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    if listener.generated:
        print(
            f"grpo serve: token {listener.token} (give the run rollout.server_token or "
            f"{TOKEN_ENV}; set {TOKEN_ENV} before grpo serve to choose it)",
            file=sys.stderr,
            flush=True,
        )
    worker.run_forever()
