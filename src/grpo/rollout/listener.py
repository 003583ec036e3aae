"""``grpo serve``'s address, bound before anything heavy loads: a wrong port, host or token is
said at once, in one line, before torch and the model (``grpo.rollout.server_http`` then serves
on it). A thread per connection, bounded, each request due within its time."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from grpo.config import ConfigError
from grpo.runtime.user_code import one_line

TOKEN_ENV = "GRPO_SERVE_TOKEN"  # the token, for both sides, where no flag or key gives it
HANDLERS = 64  # connections served at once, each on a thread
READ_S = 10.0  # the longest pause while a request arrives
REQUEST_S = 60.0  # the longest a whole request (headers and body) may take to arrive
MIN_TOKEN = 16  # characters: a short token could be guessed over the network

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def canonical(address: str) -> Address:
    """An IP address as compared here: an IPv4 address mapped into IPv6 is the IPv4 one."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def addresses(host: str) -> list[Address]:
    """``host``'s addresses, in the resolver's order (``OSError`` for a name that has none)."""
    found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(canonical(info[4][0]) for info in found))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` answers this machine only ("" and 0.0.0.0 answer every
    interface)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return all(ip.is_loopback for ip in addresses(host))
    except OSError:
        return False  # the bind says why


class Listener(ThreadingHTTPServer):
    """A thread per connection, at most ``HANDLERS``. A request must arrive within
    ``REQUEST_S`` (a sender that trickles a byte at a time keeps each read under ``READ_S``),
    and when every thread is taken the connection that has been arriving longest is cut for
    the new one: idle connections, however many, cost the run no wait."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], token: str, allowed: set[Address]) -> None:
        # its handler comes with the engine (``serve``): bound first, so that a wrong address
        # is said before the model loads
        super().__init__(address, BaseHTTPRequestHandler, bind_and_activate=False)
        self.token, self.allowed, self.generated = token, allowed, False
        self.slots = threading.BoundedSemaphore(HANDLERS)
        self.lock = threading.Lock()
        self.reading: dict[socket.socket, float] = {}  # connections still arriving: since when

    def arriving(self, connection: socket.socket) -> None:
        with self.lock:
            self.reading[connection] = time.monotonic()

    def arrived(self, connection: socket.socket) -> None:
        with self.lock:
            self.reading.pop(connection, None)

    def _cut(self, connections: list[socket.socket]) -> None:
        for connection in connections:
            self.arrived(connection)
            with contextlib.suppress(OSError):  # closed meanwhile
                connection.shutdown(socket.SHUT_RD)  # its handler reads the end and stops

    def service_actions(self) -> None:  # between accepts, twice a second
        now = time.monotonic()
        with self.lock:
            late = [c for c, since in self.reading.items() if now - since > REQUEST_S]
        self._cut(late)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            with self.lock:
                oldest = min(self.reading, key=self.reading.__getitem__, default=None)
            self._cut([] if oldest is None else [oldest])
            if not self.slots.acquire(timeout=1.0):  # every thread busy with the engine
                self.shutdown_request(request)
                return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):  # a client that hung up is no news
            print(f"grpo serve: a request failed: {one_line(err)}", file=sys.stderr, flush=True)


def listen(host: str, port: int, token: str | None, weights_hosts: list[str]) -> Listener:
    """Bind ``host:port`` (before the model loads: a wrong address is said at once), with the
    token (given, else ``GRPO_SERVE_TOKEN``, else generated) and the allowed weights hosts.
    Every refusal is a one-line ``ConfigError``."""
    if not 0 <= port < 65536:
        raise ConfigError(f"grpo serve --port {port}: a port is 0-65535 (0: any free one)")
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < MIN_TOKEN:
        raise ConfigError(f"grpo serve: a token of at least {MIN_TOKEN} characters")
    if token is not None and not (token.isascii() and token.isprintable() and " " not in token):
        # an HTTP header carries it: anything else could never match what a client sends
        raise ConfigError("grpo serve: a token of printable ASCII characters without spaces")
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"grpo serve --host {host} answers beyond this machine: give it a token "
            f"(--token or {TOKEN_ENV}) and the run the same (rollout.server_token or {TOKEN_ENV})"
        )
    allowed: set[Address] = set()
    for name in weights_hosts:
        try:
            allowed.update(addresses(name))
        except OSError as err:
            raise ConfigError(f"grpo serve --weights-hosts {name}: no address ({err})") from None
    listener = Listener((host, port), token or secrets.token_urlsafe(32), allowed)
    listener.generated = token is None
    try:
        listener.server_bind()
        listener.server_activate()
    except (OSError, OverflowError) as err:
        listener.server_close()
        said = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise ConfigError(f"grpo serve cannot listen at {host}:{port}: {said}") from None
    return listener
