"""The environments' event loop: a client dropped unclosed does not take a new server's socket
with it (grpo.environments.event_loop)."""

from __future__ import annotations

import asyncio
import gc
import socket
from importlib.util import find_spec

import pytest

from grpo.environments.event_loop import EventLoop

pytestmark = pytest.mark.skipif(
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


def test_a_client_collected_unclosed_leaves_a_new_server_on_its_descriptor_serving() -> None:
    events = EventLoop()
    for _ in range(3):  # another thread of this process may take the freed descriptor first
        freed, reused, line = events.run(drop_a_client_then_serve(), 30)
        if reused == freed:
            break
    assert reused == freed  # the case that hangs: the new server got the freed descriptor
    assert line == b"HTTP/1.1 200 OK\r\n"
    events.close()
