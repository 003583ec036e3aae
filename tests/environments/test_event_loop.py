"""The environments' event loop: a client dropped unclosed does not take a new server's socket
with it, over plain TCP and over asyncio's TLS (grpo.environments.event_loop)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shutil
import socket
import ssl
import subprocess
import threading
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from grpo.environments.event_loop import EventLoop, _SocketTransport

needs_openai = pytest.mark.skipif(
    find_spec("openai") is None, reason="the envs extra (make test installs it)"
)

BODY = b'{"object":"list","data":[]}'
REPLY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request on a connection with REPLY."""
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(REPLY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def drop_a_client_then_serve() -> tuple[int, int, bytes | None]:
    """A harness's unclosed openai client collected with its pooled connection, then a new
    server on the descriptor just freed: (freed, the server's descriptor, its first answer or
    None when it never reads the request)."""
    import openai

    first = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = first.sockets[0].getsockname()[1]
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="key", max_retries=0
    )
    await client.models.list()  # leaves an idle connection in the client's pool
    pooled = client._client._transport._pool.connections[0]
    freed = pooled._connection._network_stream._stream._transport._sock_fd
    held = {"client": client}
    held["self"] = held  # a cycle (a harness's frames, a traceback), so the collector frees it
    del client, pooled, held
    gc.collect()  # closes the socket; openai's finalizer schedules the client's aclose()
    # a new socket takes the lowest free descriptor: in a busy process lower ones may be free
    # too, so hold sockets until one gets `freed` (no await: the aclose() has not run yet)
    held_open = [socket.socket()]
    while held_open[-1].fileno() < freed:
        held_open.append(socket.socket())
    listener = held_open.pop()
    for spare in held_open:
        spare.close()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    reused = listener.fileno()
    server = await asyncio.start_server(answer, sock=listener)
    await asyncio.sleep(0.2)  # the scheduled aclose() runs
    reader, writer = await asyncio.open_connection(*listener.getsockname())
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: here\r\n\r\n")
    try:
        line: bytes | None = await asyncio.wait_for(reader.readline(), 5)
    except asyncio.TimeoutError:
        line = None
    writer.close()
    server.close()
    first.close()
    return freed, reused, line


@needs_openai
def test_a_client_collected_unclosed_leaves_a_new_server_on_its_descriptor_serving() -> None:
    events = EventLoop()
    for _ in range(3):  # another thread of this process may take the freed descriptor first
        freed, reused, line = events.run(drop_a_client_then_serve(), 30)
        if reused == freed:
            break
    assert reused == freed  # the case that hangs: the new server got the freed descriptor
    assert line == b"HTTP/1.1 200 OK\r\n"
    events.close()


async def tls_round_trip(certificate: Path, key: Path) -> tuple[type, type, bytes]:
    """One request over asyncio's own TLS on the loop: (the client's socket transport class,
    the server's, the answer's first line)."""
    served: list[asyncio.StreamWriter] = []

    async def answer_tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(writer)
        await answer(reader, writer)

    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(certificate, key)
    client_side = ssl.create_default_context(cafile=certificate)
    server = await asyncio.start_server(answer_tls, "127.0.0.1", 0, ssl=server_side)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_side, server_hostname="localhost"
    )
    writer.write(b"GET / HTTP/1.1\r\nHost: here\r\n\r\n")
    line = await asyncio.wait_for(reader.readline(), 5)
    raw = [w.transport._ssl_protocol._transport for w in (writer, served[0])]
    writer.close()
    server.close()
    return type(raw[0]), type(raw[1]), line


@pytest.mark.skipif(shutil.which("openssl") is None, reason="makes its certificate with openssl")
def test_connections_over_asyncio_tls_are_guarded_too(tmp_path: Path) -> None:
    certificate, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(certificate)],
        check=True, capture_output=True,
    )  # fmt: skip
    events = EventLoop()
    client, server, line = events.run(tls_round_trip(certificate, key), 30)
    events.close()
    assert line == b"HTTP/1.1 200 OK\r\n"
    assert client is server is _SocketTransport


def test_closing_ends_the_loops_thread_and_cancels_its_tasks(capsys) -> None:
    events = EventLoop()
    sleeping = asyncio.run_coroutine_threadsafe(asyncio.sleep(3600), events.loop)
    events.close(timeout_s=2)
    assert sleeping.cancelled() and not events.thread.is_alive() and events.loop.is_closed()
    assert capsys.readouterr().err == ""


def test_a_task_that_ignores_cancellation_is_said_when_abandoned(capsys) -> None:
    events = EventLoop()
    done = asyncio.Event()

    async def stubborn() -> None:
        while not done.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    events.loop.call_soon_threadsafe(lambda: events.loop.create_task(stubborn(), name="stubborn"))
    time.sleep(0.1)
    events.close(timeout_s=0.3)
    assert capsys.readouterr().err == (
        "environment: event loop closed with tasks that ignored cancellation for 0.3 s, "
        "abandoned: stubborn\n"
    )
    assert not events.thread.is_alive() and events.loop.is_closed()


def test_a_loop_held_by_a_blocking_call_is_said_and_keeps_its_thread(capsys) -> None:
    events = EventLoop()
    release = threading.Event()

    async def blocking() -> None:
        release.wait(30)  # a synchronous call inside a coroutine holds the whole loop

    asyncio.run_coroutine_threadsafe(blocking(), events.loop)
    events.close(timeout_s=0.2)
    assert capsys.readouterr().err == (
        "environment: event loop still busy after 1.4 s (a blocking call holds it); its "
        "thread is left running\n"
    )
    assert events.thread.is_alive()
    release.set()  # the loop runs again: the stop already asked for ends its thread
    events.thread.join(5)
    assert not events.thread.is_alive()
