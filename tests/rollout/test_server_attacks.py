"""``grpo serve`` against a second client on the same host, as an adversary would try it: without
the token nothing changes and ``/health`` names nothing to replay; idle, trickling, malformed
and oversized requests neither stall the server nor stop a run; a weights session joins only an
allowed host, within its timeout; every failure is one line, at start (exit 2) and per request."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from run_logs import step_rows as rows
from served import ROLLOUT, TOKEN, Running, serve_command, start_server

from grpo.config import ConfigError, ModelConfig, RolloutConfig
from grpo.models import load_policy, load_tokenizer
from grpo.rollout import listener, server_http
from grpo.rollout.server import ServerEngine, ServerLost, pushed_weights
from grpo.runtime.weight_sync import SECRET_BYTES
from grpo.training.trainer import train

STACK_MARKS = ("Traceback", "frame #", "Exception raised from", "[W", "[E")


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path) -> Iterator[Running]:
    server = start_server(tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname, parts.port


def ask(
    url: str, method: str, path: str, body: dict | None = None, token: str | None = TOKEN
) -> tuple[int, dict]:
    """One request; its status and JSON answer."""
    connection = http.client.HTTPConnection(*address(url), timeout=30)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    data = None if body is None else json.dumps(body).encode()
    try:
        connection.request(method, path, body=data, headers=headers)
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


def health_within(url: str, seconds: float = 2.0) -> None:
    t0 = time.monotonic()
    assert ask(url, "GET", "/health", token=None) == (200, {"status": "ok"})
    assert time.monotonic() - t0 < seconds


def raw(url: str, data: bytes) -> socket.socket:
    """A connection that sent ``data`` and nothing more (yet)."""
    sock = socket.create_connection(address(url), timeout=30)
    sock.sendall(data)
    return sock


def raw_status(sock: socket.socket) -> int:
    return int(sock.recv(4096).split(b" ", 2)[1])


@contextlib.contextmanager
def never_answering(host: str = "127.0.0.1") -> Iterator[tuple[int, list[socket.socket]]]:
    """A port that accepts connections and never says a word; the connections it took."""
    listener = socket.create_server((host, 0))
    taken: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                taken.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], taken
    finally:
        listener.close()
        for sock in taken:
            sock.close()


def weights_init(tiny_model_dir: Path, host: str, port: int, timeout_s: float) -> dict:
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    names = [[name, list(t.shape)] for name, t in pushed_weights(model).items()]
    return {
        "host": host,
        "port": port,
        "timeout_s": timeout_s,
        "names": names,
        "secret": "00" * SECRET_BYTES,
    }


def console(server: Running, saying: str = "", seconds: float = 10.0) -> list[str]:
    """The server's console so far (read by another thread), once a line says ``saying``."""
    deadline = time.monotonic() + seconds
    while not any(saying in line for line in server.lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    return list(server.lines)


def engine(tiny_model_dir: Path, url: str, token: str) -> ServerEngine:
    config = RolloutConfig(
        **ROLLOUT, engine="server", server_url=url, server_token=token, server_timeout_s=20
    )
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    return ServerEngine(model, load_tokenizer(str(tiny_model_dir)), config)


# ------------------------------------------------------------------------- the token


def test_without_the_token_or_with_a_wrong_one_nothing_changes(
    running: Running, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = running.url
    before = ask(url, "GET", "/info")
    assert before[0] == 200
    with never_answering() as (port, taken):
        requests = [
            ("GET", "/info", None),
            ("POST", "/generate", {"prompts": ["1+1="], "group_size": 2, "session": ""}),
            ("POST", "/weights/init", weights_init(tiny_model_dir, "127.0.0.1", port, 5)),
            ("POST", "/weights/update", {"session": before[1]["session"], "version": 0}),
        ]
        for token, status in ((None, 401), ("a-wrong-token-0123456789", 403), (TOKEN + "x", 403)):
            for method, path, body in requests:
                said = ask(url, method, path, body, token)
                assert said[0] == status, (token, path, said)
                assert "token" in said[1]["error"]
        assert taken == []  # no weights session was tried
    assert ask(url, "GET", "/info") == before
    # the run's side says it in one line: no token, a wrong one; the config key's token passes
    monkeypatch.delenv("GRPO_SERVE_TOKEN", raising=False)
    with pytest.raises(ServerLost, match=r"failed /info: a token is needed: .*server_token"):
        engine(tiny_model_dir, url, "")._check()
    with pytest.raises(ServerLost, match="failed /info: wrong token"):
        engine(tiny_model_dir, url, "a-wrong-token-0123456789")._check()
    engine(tiny_model_dir, url, TOKEN)._check()


def test_a_server_url_that_is_not_an_address_is_one_line(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout.server_url 'not-a-url' is not a server's add"):
        engine(tiny_model_dir, "not-a-url", TOKEN)


def test_health_names_no_session_to_replay(running: Running, tiny_model_dir: Path) -> None:
    client = engine(tiny_model_dir, running.url, TOKEN)
    client.generate(["1+1="], [{}], 2, seeds=[1])  # a weights session, one push
    status, info = ask(running.url, "GET", "/info")
    assert status == 200 and info["session"] == client.weights_session and info["version"] == 1
    connection = http.client.HTTPConnection(*address(running.url), timeout=30)
    connection.request("GET", "/health")
    body = connection.getresponse().read()
    assert json.loads(body) == {"status": "ok"}
    assert client.weights_session.encode() not in body


def test_a_generated_token_is_printed_and_required(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPO_SERVE_TOKEN"}
    command = serve_command(tiny_model_dir, "--port", "0")
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        started = process.stderr.readline()
        while "grpo serve:" not in started and started:
            started = process.stderr.readline()
        said = process.stderr.readline()
        assert said.startswith("grpo serve: token "), said
        token = said.split()[3]
        url = started.rsplit(" at ", 1)[1].strip()
        assert len(token) >= 32
        assert ask(url, "GET", "/info", token=None)[0] == 401
        assert ask(url, "GET", "/info", token=token)[0] == 200
    finally:
        process.kill()
        process.wait()


# ------------------------------------------------------------------------- bounds


def test_a_second_client_cannot_stall_or_stop_a_run(
    tiny_config, running: Running, tiny_model_dir: Path
) -> None:
    url = running.url
    start = b"POST /generate HTTP/1.1\r\nHost: x\r\n"
    held = [raw(url, b"") for _ in range(8)]  # idle connections
    stop = threading.Event()

    def trickle() -> None:  # one byte at a time, as long as the run lasts
        with contextlib.suppress(OSError), raw(url, b"P") as sock:
            for byte in start[1:] * 1000:
                if stop.wait(0.2):
                    return
                sock.sendall(bytes([byte]))

    def forge() -> None:  # pushes and sessions without the token, all run long
        while not stop.is_set():
            ask(url, "POST", "/weights/update", {"session": "", "version": 0}, token=None)
            ask(url, "POST", "/weights/init", {"host": "127.0.0.1", "port": 1}, token=None)
            stop.wait(0.1)

    threads = [threading.Thread(target=f, daemon=True) for f in (trickle, forge)]
    for thread in threads:
        thread.start()
    try:
        health_within(url)
        # a negative or missing Content-Length, and a body past the cap: answered at once,
        # before anything is read
        auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
        for header, status in (
            (b"Content-Length: -5\r\n", 400),
            (b"", 400),
            (f"Content-Length: {300 << 20}\r\n".encode(), 413),
            ("Content-Length: \u00b2\r\n".encode("latin-1"), 400),  # a digit to isdigit()
            (b"Content-Length: " + b"9" * 5000 + b"\r\n", 400),  # past int()'s digit limit
            (b"".join(b"X-%d: 1\r\n" % i for i in range(101)), 431),  # http.server's own
        ):
            t0 = time.monotonic()
            with raw(url, start + auth + header + b"\r\n") as sock:
                assert raw_status(sock) == status
            assert time.monotonic() - t0 < 2
        health_within(url)

        def run(name: str, engine: dict):
            config = tiny_config(
                rollout={**ROLLOUT, **engine},
                train={"steps": 2, "threads": 1, "run_name": name, "eval_every": 0},
            )
            return rows(train(config))

        served = run("attacked", {"engine": "server", "server_url": url, "server_token": TOKEN})
        health_within(url)
    finally:
        stop.set()
        for sock in held:
            sock.close()
    assert served == run("own", {"engine": "hf"})  # the same run, as if no one else were there
    lines = console(running, "failed (401)")
    assert not any(mark in line for line in lines for mark in STACK_MARKS), lines


@pytest.fixture
def small_listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[listener.Listener]:
    """The server's HTTP side in this process, with 4 threads and requests due in 1 s; an
    engine that only answers ``/info``."""
    monkeypatch.setattr(listener, "HANDLERS", 4)
    monkeypatch.setattr(listener, "REQUEST_S", 1.0)

    class Info:
        def info(self) -> dict:
            return {"session": ""}

    server = listener.listen("127.0.0.1", 0, TOKEN, [])
    server.RequestHandlerClass = server_http.handler_for(
        Info(), server_http.EngineThread(), TOKEN, set()
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    for thread in threading.enumerate():  # every handler done, its line said, in this test
        if "process_request_thread" in thread.name:
            thread.join(10)
    server.server_close()


def test_more_idle_connections_than_threads_cost_no_wait(
    small_listener: listener.Listener,
) -> None:
    url = small_listener.url
    held = [raw(url, b"GET /info HTTP/1.1\r\n") for _ in range(12)]
    try:
        for _ in range(3):
            health_within(url)
            assert ask(url, "GET", "/info") == (200, {"session": ""})
    finally:
        for sock in held:
            sock.close()


def test_a_trickling_request_is_cut_when_due(small_listener: listener.Listener) -> None:
    with raw(small_listener.url, b"P") as sock:
        t0 = time.monotonic()
        with contextlib.suppress(OSError):  # the cut ends the connection
            for byte in b"OST /generate HTTP/1.1\r\nHost: x\r\n" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
                if time.monotonic() - t0 > 10:
                    break
        assert time.monotonic() - t0 < 5  # REQUEST_S 1, checked twice a second


# ------------------------------------------------------------------------- weights sessions


def test_a_weights_session_with_a_host_not_allowed_is_refused(
    running: Running, tiny_model_dir: Path
) -> None:
    # the client is 127.0.0.1 as the server sees it; 127.0.0.2 is another host to it
    with never_answering("127.0.0.2") as (port, taken):
        status, said = ask(
            running.url, "POST", "/weights/init", weights_init(tiny_model_dir, "127.0.0.2", port, 5)
        )
        assert status == 403, said
        assert (
            "127.0.0.2 (127.0.0.2) is neither the client's own address (127.0.0.1)"
            in (said["error"])
        )
        assert taken == []


def test_the_weights_host_is_the_clients_own_or_an_allowed_one() -> None:
    import ipaddress

    client = ipaddress.ip_address("127.0.0.1")
    request = {"port": 5, "timeout_s": 1, "names": [], "secret": "ab" * SECRET_BYTES}
    assert server_http.weights_address({**request, "host": "localhost"}, client, set()) == (
        "127.0.0.1"
    )
    other = {**request, "host": "127.0.0.2"}
    with pytest.raises(PermissionError, match="nor one of --weights-hosts"):
        server_http.weights_address(other, client, set())
    allowed = {ipaddress.ip_address("127.0.0.2")}
    assert server_http.weights_address(other, client, allowed) == "127.0.0.2"
    bad_requests = (
        {"port": 0},
        {"port": "1"},
        {"timeout_s": float("inf")},
        {"names": None},
        {"secret": "ab"},
        {"secret": "zz" * SECRET_BYTES},
    )
    for bad in bad_requests:
        with pytest.raises(ValueError, match="/weights/init needs"):
            server_http.weights_address({**other, **bad}, client, allowed)


@pytest.mark.parametrize("peer", ["never answers", "refuses"])
def test_a_rendezvous_that_fails_ends_within_its_timeout_in_one_line(
    running: Running, tiny_model_dir: Path, peer: str
) -> None:
    # a port that accepts and never answers held torch's store for ever (over 400 s measured);
    # a closed one made it print its retries with C++ stacks
    with never_answering() as (port, taken):
        if peer == "refuses":
            port = socket.create_server(("127.0.0.1", 0)).getsockname()[1]  # closed at once
        probes: list[float] = []

        def probe() -> None:  # the server answers others meanwhile
            t0 = time.monotonic()
            health_within(running.url)
            probes.append(time.monotonic() - t0)

        t0 = time.monotonic()
        thread = threading.Timer(0.5, probe)
        thread.start()
        status, said = ask(
            running.url, "POST", "/weights/init", weights_init(tiny_model_dir, "127.0.0.1", port, 2)
        )
        elapsed = time.monotonic() - t0
        thread.join()
        assert status == 500 and "no weights group at 127.0.0.1" in said["error"], said
        assert elapsed < 8, elapsed  # timeout_s 2 (the store's own retry rounds it up)
        assert probes and probes[0] < 2
        assert (peer == "refuses") or taken  # it did connect, and gave up
    lines = console(running, f"127.0.0.1:{port}")
    said = [line for line in lines if f"127.0.0.1:{port}" in line]
    assert len(said) == 1 and "POST /weights/init failed (500)" in said[0], said
    assert said[0].rstrip().endswith("(from 127.0.0.1)"), said
    assert not any(mark in line for line in lines for mark in STACK_MARKS), lines


def test_a_client_that_hangs_up_early_leaves_no_traceback(running: Running) -> None:
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    body = json.dumps({"prompts": ["1+1="], "group_size": 2, "session": "x", "version": 0})
    whole = f"POST /generate HTTP/1.1\r\nContent-Length: {len(body)}\r\n".encode()
    raw(running.url, whole + auth + b"\r\n" + body.encode()).close()  # before the answer
    raw(
        running.url, b"POST /generate HTTP/1.1\r\nContent-Length: 100\r\n" + auth + b"\r\n{"
    ).close()
    # the engine answers in order: this one's answer comes after the first's
    assert ask(running.url, "POST", "/generate", {"session": "x", "version": 0})[0] == 500
    health_within(running.url)
    lines = console(running, "failed (408)")
    assert not any(mark in line for line in lines for mark in STACK_MARKS), lines


# ------------------------------------------------------------------------- start-up


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        yield taken.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--port", "99999"], "grpo serve --port 99999: a port is 0-65535"),
        (["--port", "{taken}"], "cannot listen at 127.0.0.1:{taken}: Address already in use"),
        (
            ["--host", "203.0.113.7", "--token", TOKEN],
            "cannot listen at 203.0.113.7:8000: Cannot assign requested address",
        ),
        (["--host", "0.0.0.0"], "grpo serve --host 0.0.0.0 answers beyond this machine: give"),
        (["--token", "short"], "a token of at least 16 characters"),
        (["--weights-hosts", "nohost.invalid"], "--weights-hosts nohost.invalid: no address"),
    ],
    ids=["port-range", "port-in-use", "not-this-machine", "no-token", "short-token", "hosts"],
)
def test_start_up_errors_are_one_line_and_exit_2(
    tiny_model_dir: Path,
    taken_port: int,
    args: list[str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from grpo.cli import main

    monkeypatch.delenv("GRPO_SERVE_TOKEN", raising=False)
    args = [arg.format(taken=taken_port) for arg in args]
    assert main(serve_command(tiny_model_dir, *args)[3:]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo: error: "), err
    assert said.format(taken=taken_port) in err


def test_a_start_up_error_of_the_command_is_one_line(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPO_SERVE_TOKEN"}
    command = serve_command(tiny_model_dir, "--port", "99999")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert (
        done.stderr == "grpo: error: grpo serve --port 99999: a port is 0-65535 (0: any free one)\n"
    )
