"""One asyncio loop on a daemon thread, shared by an environment's sessions: the clients of
OpenEnv servers and verifiers harnesses are async, the turn loop calls them from its threads.

The loop's socket transports do not touch a descriptor once the garbage collector has closed it
(CPython issue 130141, open in 3.11-3.14). An async client dropped without being closed (an
``openai.AsyncOpenAI`` a harness makes per episode, say) is collected with its connections; its
finalizer resurrects it to close them on the running loop a moment later. By then the
collector has closed each connection's socket, and the descriptor may already belong to a new
socket (the next episode's interception server): closing the old transport then unregisters the
new socket from the loop, which never reads it again. An episode whose harness called that
server would wait for ever for its first model call. The guard covers plain connections
(httpx's, TLS included, and aiohttp's servers) and those over asyncio's own TLS (an aiohttp
client's https).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import warnings
from asyncio import selector_events
from collections.abc import Coroutine
from typing import Any


class _SocketTransport(selector_events._SelectorSocketTransport):
    """A socket transport that, collected with its socket still open, marks itself closed."""

    def __del__(self, _warn: Any = warnings.warn) -> None:
        if self._sock is not None:
            # the descriptor is freed below and may be reused at once: a later close() or
            # abort() of this transport (from a finalizer that resurrected it) must not
            # unregister whatever owns the number by then
            self._closing = True
            self._conn_lost += 1
        super().__del__(_warn)


class _Loop(asyncio.SelectorEventLoop):
    def _make_socket_transport(
        self,
        sock: Any,
        protocol: Any,
        waiter: Any = None,
        *,
        extra: Any = None,
        server: Any = None,
    ) -> _SocketTransport:
        return _SocketTransport(self, sock, protocol, waiter, extra, server)

    def _make_ssl_transport(self, rawsock: Any, *args: Any, **kwargs: Any) -> Any:
        # asyncio's own TLS (an aiohttp client's https) builds its socket transport inside;
        # the loop keeps it by descriptor, where it is given the same guard
        transport = super()._make_ssl_transport(rawsock, *args, **kwargs)
        raw = self._transports.get(rawsock.fileno())
        if type(raw) is selector_events._SelectorSocketTransport:
            raw.__class__ = _SocketTransport
        return transport


class EventLoop:
    """The loop and its thread (see the module docstring)."""

    def __init__(self) -> None:
        self.loop = _Loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, work: Coroutine, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(work, timeout_s), self.loop)
        return future.result()

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel what still runs on the loop, then stop it and end its thread. Tasks that
        ignore their cancellation for ``timeout_s`` are abandoned with the loop, and a loop
        that a blocking call holds keeps its (daemon) thread: each said in one line."""
        if self.loop.is_closed():
            return
        cancelled = asyncio.run_coroutine_threadsafe(_cancel_all(timeout_s), self.loop)
        stuck: list[str] = []
        with contextlib.suppress(TimeoutError, concurrent.futures.TimeoutError):
            stuck = cancelled.result(timeout_s + 1)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            waited = 2 * timeout_s + 1
            _say(
                f"event loop still busy after {waited:g} s (a blocking call holds it); its "
                "thread is left running"
            )
            return
        self.loop.close()
        if stuck:
            _say(
                f"event loop closed with tasks that ignored cancellation for {timeout_s:g} s, "
                f"abandoned: {', '.join(stuck)}"
            )


def _say(what: str) -> None:
    print(f"environment: {what}", file=sys.stderr, flush=True)


async def _cancel_all(timeout_s: float) -> list[str]:
    """Cancel every other task on this loop; the names of those still running after
    ``timeout_s``."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    return sorted(task.get_name() for task in pending)
