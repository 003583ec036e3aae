"""``grpo serve`` and ``rollout.engine: server``: a run that generates on a rollout server (the
HF engine in another process, weights pushed over gloo after every step) computes what the
same run with its own HF engine computes; a server that samples otherwise is refused, and one
that dies stops the run with a checkpoint and one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from faults import record
from run_logs import step_rows as rows
from served import ROLLOUT, TOKEN, start_server

from grpo.config import ConfigError
from grpo.models import build_tiny_model
from grpo.rollout import RolloutLost
from grpo.rollout.server import ServerLost, decode_rollout, encode_rollout, no_answer_cause
from grpo.training.trainer import Trainer, train


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[str]:
    running = start_server(tiny_model_dir)
    yield running.url
    running.stop()


@pytest.fixture(autouse=True)
def _client_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # the run's side, and its producer process's (which inherits the environment)
    monkeypatch.setenv("GRPO_SERVE_TOKEN", TOKEN)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_rollout_travels_whole() -> None:
    from grpo.scoring.distribution import Decoding
    from grpo.step_data import Rollout

    rollout = Rollout(
        prompt_ids=torch.tensor([[1, 2]]),
        prompt_mask=torch.tensor([[True, True]]),
        completion_ids=torch.tensor([[3, 4]]),
        completion_mask=torch.tensor([[True, False]]),
        truncated=torch.tensor([False]),
        prompts=["p"],
        completions=["c"],
        rows=[{"x": 1}],
        group_size=1,
        sampler_logp=torch.tensor([[-0.1234567, 0.0]]),
        decoding=Decoding(temperature=0.7, top_k=5),
    )
    back = decode_rollout(encode_rollout(rollout), [{"x": 1}])
    for name in ("prompt_ids", "completion_mask", "truncated", "sampler_logp"):
        assert torch.equal(getattr(back, name), getattr(rollout, name)), name
    assert back.sampled_mask is None and back.decoding == rollout.decoding
    assert back.rows == [{"x": 1}] and back.completions == ["c"]


def test_a_run_on_the_server_computes_what_its_own_engine_does(
    tiny_config, server: str, weights, tiny_model_dir
) -> None:
    def run(name: str, engine: dict):
        config = tiny_config(
            rollout={**ROLLOUT, **engine},
            optim={"lr": 1e-2},
            train={"steps": 3, "threads": 1, "run_name": name, "eval_every": 3, "eval_examples": 4},
        )
        return train(config)

    own = run("own", {"engine": "hf"})
    served = run("served", {"engine": "server", "server_url": server})
    weights.assert_moved(weights.of(tiny_model_dir), weights.of(own / "final"))
    # the same tokens (per-row seeds, the same weights pushed each step), the same updates,
    # the same greedy evaluation
    assert rows(served) == rows(own)
    a, b = weights.of(own / "final"), weights.of(served / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_server_that_samples_otherwise_is_one_line(tiny_config, server: str) -> None:
    config = tiny_config(
        rollout={**ROLLOUT, "engine": "server", "server_url": server, "top_k": 5},
        train={"steps": 1, "threads": 1},
    )
    with pytest.raises(ServerLost, match=r"samples otherwise than this run \(top_k 0 -> 5\)"):
        train(config)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda t: t.add_tokens(["<extra>"]), r"vocab_size \d+ -> \d+; vocab_sha256"),
        (lambda t: setattr(t, "eos_token", t.convert_ids_to_tokens(5)), r"eos_token_id \d+ -> 5"),
    ],
    ids=["vocabulary", "eos"],
)
def test_a_server_with_another_tokenizer_is_one_line(
    server: str, tiny_model_dir: Path, change, said: str
) -> None:
    # the server returns token ids that the trainer reads with its own vocabulary: a tokenizer
    # with another token, or another end token, is refused before anything is sampled
    from grpo.config import ModelConfig, RolloutConfig
    from grpo.models import load_policy, load_tokenizer
    from grpo.rollout.server import ServerEngine

    config = RolloutConfig(**ROLLOUT, engine="server", server_url=server, server_timeout_s=20)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    ServerEngine(model, tokenizer, config)._check()  # the same tokenizer passes
    change(tokenizer)
    with pytest.raises(ServerLost, match=r"has another tokenizer than this run.s \(" + said):
        ServerEngine(model, tokenizer, config).generate(["1+1="], [{}], 2, seeds=[1])


def test_tools_are_refused_on_the_server_engine(tiny_config) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.tools runs its turn loop"):
        tiny_config(rollout={"engine": "server", "tools": ["python"]})


def test_a_server_that_dies_stops_the_run_with_a_checkpoint(
    tiny_config, tiny_model_dir: Path, monkeypatch
) -> None:
    running = start_server(tiny_model_dir)
    process, url = running.process, running.url
    update = Trainer.optimize

    def optimize(self: Trainer, scored):
        if self.state.step == 2:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        return update(self, scored)

    monkeypatch.setattr(Trainer, "optimize", optimize)
    config = tiny_config(
        rollout={**ROLLOUT, "engine": "server", "server_url": url, "server_timeout_s": 5.0},
        train={"steps": 4, "save_every": 0, "threads": 1, "run_name": "dies"},
    )
    t0 = time.monotonic()
    with pytest.raises(RolloutLost) as lost:
        train(config)
    said = str(lost.value)
    # the push after step 2's update finds no server: step 2 is kept, logged and saved
    assert "\n" not in said and said.startswith(f"the rollout server at {url}"), said
    assert said.endswith(
        "after step 2: " + str(config.run_dir / "checkpoints" / "step-2") + " is complete"
    ), said
    assert time.monotonic() - t0 < 60
    assert [r["step"] for r in rows(config.run_dir)] == [1, 2]


def _answering_with(body: bytes) -> type[BaseHTTPRequestHandler]:
    """A request handler that answers every GET and POST with ``body``."""

    class Answering(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args) -> None:
            pass

    return Answering


def _garble(running) -> HTTPServer:
    """Another server in its place, on its port, answering every request with garbage."""
    running.stop()
    port = int(running.url.rsplit(":", 1)[1])
    other = HTTPServer(("127.0.0.1", port), _answering_with(b"\x00garbage\xff"))
    threading.Thread(target=other.serve_forever, daemon=True).start()
    return other


# the fault matrix's cells for grpo serve (docs/checkpoints.md), in step 2's update: the
# weights' push after it fails, step 2 is kept and saved, and the same command resumes on a
# restarted server (its address changes: an operational key)
SERVER_FAULTS = {
    "kill": lambda r: (os.kill(r.process.pid, signal.SIGKILL), r.process.wait()),
    "stop": lambda r: os.kill(r.process.pid, signal.SIGSTOP),
    "garbage": _garble,
}
# the push's first request asks whether the server still holds this run's weights
SERVER_LINES = {
    "kill": "did not answer /info: nothing listens there (the server exited, or was never "
    "started on that port)",
    "stop": "did not answer /info: nothing came back within rollout.server_timeout_s (5 s)",
    "garbage": "answered /info with something other than grpo serve's JSON: is "
    "rollout.server_url a grpo serve?",
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop", "garbage"])
def test_a_lost_server_stops_the_run_with_a_checkpoint_and_the_same_command_resumes(
    tiny_config, tiny_model_dir: Path, monkeypatch, fault: str
) -> None:
    running = start_server(tiny_model_dir)
    injected: list[float] = []
    left: list = []  # what a fault leaves running
    update = Trainer.optimize

    def optimize(self: Trainer, scored):
        if self.state.step == 2:
            left.append(SERVER_FAULTS[fault](running))
            injected.append(time.monotonic())
        return update(self, scored)

    monkeypatch.setattr(Trainer, "optimize", optimize)
    served = {**ROLLOUT, "engine": "server", "server_url": running.url, "server_timeout_s": 5.0}
    train_keys = {"steps": 4, "save_every": 0, "threads": 1, "run_name": f"lost-{fault}"}
    config = tiny_config(rollout=served, train=train_keys)
    try:
        with pytest.raises(ServerLost) as lost:
            train(config)
    finally:
        running.stop()
        if isinstance(left[0], HTTPServer):
            left[0].shutdown()
    seconds = time.monotonic() - injected[0]
    said = str(lost.value)
    step_2 = config.run_dir / "checkpoints" / "step-2"
    line = f"the rollout server at {running.url} {SERVER_LINES[fault]}"
    assert said == f"{line} after step 2: {step_2} is complete", said
    assert seconds < 5.0 + 30, seconds  # the update, then the timeout at most (generous)
    record(f"grpo serve/{fault}", seconds, said)
    monkeypatch.setattr(Trainer, "optimize", update)
    again = start_server(tiny_model_dir)
    try:
        served = {**served, "server_url": again.url}
        run_dir = train(tiny_config(rollout=served, train={**train_keys, "resume": "auto"}))
    finally:
        again.stop()
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]


def test_a_producer_process_generates_on_the_server(tiny_config, server: str) -> None:
    # max_staleness 1: the producer process is the server's client and pushes it the weights
    config = tiny_config(
        rollout={**ROLLOUT, "engine": "server", "server_url": server, "max_staleness": 1},
        algorithm={"tis_cap": 2.0},
        train={"steps": 3, "threads": 2, "run_name": "ahead-served"},
    )
    logged = rows(train(config))
    assert [r["staleness/max"] for r in logged] == [0, 1, 1]
    # every push reached the server: the same run on the producer's own HF engine
    own = tiny_config(
        rollout={**ROLLOUT, "max_staleness": 1},
        algorithm={"tis_cap": 2.0},
        train={"steps": 3, "threads": 2, "run_name": "ahead-own"},
    )
    assert rows(train(own)) == logged


@pytest.mark.slow
def test_a_vllm_server_samples_with_the_pushed_weights(
    tiny_config, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # `make vllm`: grpo serve --engine vllm. At lr 1e-2 the tiny model moves far each step, so
    # a server that kept its first weights would disagree with the trainer's log-probs by whole
    # nats; one that took every push agrees to vLLM's kernel noise
    pytest.importorskip("vllm")
    # vLLM's CPU attention refuses the tiny model's head size (16): a wider one
    wide = build_tiny_model(tmp_path_factory.mktemp("wide") / "model", hidden_size=256)
    running = start_server(wide, "--engine", "vllm")
    process, url = running.process, running.url
    try:
        config = tiny_config(
            model={"name": str(wide)},
            rollout={**ROLLOUT, "engine": "server", "server_url": url},
            optim={"lr": 1e-2},
            train={"steps": 3, "threads": 1, "run_name": "vllm-served"},
        )
        logged = rows(train(config))
    finally:
        process.kill()
        process.wait()
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert all(r["tis/mismatch_mean"] < 0.05 for r in logged), [
        r["tis/mismatch_mean"] for r in logged
    ]


def test_a_second_run_on_the_same_server_stops_the_first(server: str, tiny_model_dir: Path) -> None:
    # each run pushes its weights before its first request; a run whose server took another
    # run's weights since stops in one line instead of sampling them
    from grpo.config import ModelConfig, RolloutConfig
    from grpo.models import load_policy, load_tokenizer
    from grpo.rollout.server import ServerEngine

    config = RolloutConfig(**ROLLOUT, engine="server", server_url=server, server_timeout_s=20)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    models = [load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir)) for _ in "ab"]
    with torch.no_grad():
        for p in models[1].parameters():
            p.add_(0.1)
    first, second = (ServerEngine(m, tokenizer, config) for m in models)
    prompts, rows_ = ["1+1="], [{}]
    first.generate(prompts, rows_, 2, seeds=[1])
    second.generate(prompts, rows_, 2, seeds=[1])
    with pytest.raises(ServerLost, match=r"holds other weights .* another run pushes its weights"):
        first.generate(prompts, rows_, 2, seeds=[1])
    with pytest.raises(ServerLost, match="holds another run's weights now"):
        first.sync_weights(models[0])
    second.sync_weights(models[1])  # the run that took it goes on
    second.generate(prompts, rows_, 2, seeds=[1])


def test_a_server_of_another_model_is_refused_at_once_with_its_reason(
    tiny_config, tmp_path: Path
) -> None:
    # same decoding controls, other weights: the server refuses the weights group, and the
    # client says why at once instead of waiting out the group's timeout
    other = build_tiny_model(tmp_path / "other", num_layers=3)
    running = start_server(other)
    process, url = running.process, running.url
    try:
        config = tiny_config(
            rollout={**ROLLOUT, "engine": "server", "server_url": url},
            train={"steps": 1, "threads": 1},
        )
        t0 = time.monotonic()
        with pytest.raises(
            ServerLost, match=r"failed /weights/init: .* is not among the client's: another model"
        ):
            train(config)
        assert time.monotonic() - t0 < 60  # server_timeout_s is 600
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def answering(body: bytes) -> Iterator[str]:
    """A server that is not grpo serve's, answering every request with ``body``; its URL."""
    other = HTTPServer(("127.0.0.1", 0), _answering_with(body))
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{other.server_address[1]}"
    finally:
        other.shutdown()


@pytest.mark.parametrize("body", [b"", b"not json", b"[1, 2]", b'{"status": "ok"}'])
def test_a_server_that_is_not_grpo_serve_is_one_line(tiny_config, body: bytes) -> None:
    # e.g. vLLM's own server on the same port: its /health answers 200 with an empty body
    with answering(body) as url:
        config = tiny_config(
            rollout={**ROLLOUT, "engine": "server", "server_url": url},
            train={"steps": 1, "threads": 1},
        )
        with pytest.raises(ServerLost, match=r"is rollout\.server_url a grpo serve"):
            train(config)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            lambda h: h["sampling"].update(pack_float32=True),
            r"samples otherwise than this run \(pack_float32 True -> False\)",
        ),
        (
            lambda h: h["sampling"].update(compile=True),
            r"samples otherwise than this run \(compile True -> False\)",
        ),
        (  # a grpo serve from before the fingerprint and pack_float32
            lambda h: (h.pop("tokenizer"), h["sampling"].pop("pack_float32")),
            "does not say which tokenizer it holds: a grpo serve older than this run's",
        ),
        (lambda h: h.update(sampling=[1]), "fields that are not grpo serve's"),
        (lambda h: h.update(tokenizer="x"), "fields that are not grpo serve's"),
    ],
    ids=[
        "packed-float32",
        "compiled",
        "older-server",
        "sampling-not-a-dict",
        "tokenizer-not-a-dict",
    ],
)
def test_a_server_is_checked_for_float32_packing_and_its_tokenizer(
    tiny_model_dir: Path, change, said: str
) -> None:
    # a server whose float32 products round otherwise samples other tokens; one from before
    # the tokenizer's fingerprint cannot be checked; fields of another shape are not grpo
    # serve's: each is one line, never a traceback
    from grpo.config import ModelConfig, RolloutConfig
    from grpo.models import load_policy, load_tokenizer
    from grpo.rollout.server import DECODING_KEYS, ServerEngine, tokenizer_fingerprint

    config = RolloutConfig(**ROLLOUT, engine="server", server_timeout_s=20)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    health = {
        "sampling": {key: getattr(config, key) for key in DECODING_KEYS},
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    change(health)
    with answering(json.dumps(health).encode()) as url:
        engine = ServerEngine(
            load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir)),
            tokenizer,
            config.model_copy(update={"server_url": url}),
        )
        with pytest.raises(ServerLost, match=said):
            engine.generate(["1+1="], [{}], 2, seeds=[1])


def test_a_server_that_forgot_its_session_is_one_line(tiny_model_dir: Path) -> None:
    # before each later push the client asks whose weights the server holds; an answer with
    # no session (a restarted or other server) is another run's, said in one line
    from grpo.config import ModelConfig, RolloutConfig
    from grpo.models import load_policy
    from grpo.rollout.server import ServerEngine

    config = RolloutConfig(**ROLLOUT, engine="server", server_timeout_s=20)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    with answering(json.dumps({"status": "ok"}).encode()) as url:
        engine = ServerEngine(model, None, config.model_copy(update={"server_url": url}))
        engine.sender, engine.weights_session = (None, []), "abc"  # after a first push
        with pytest.raises(
            ServerLost, match=r"another run's weights now \(session None, not .*abc"
        ):
            engine.sync_weights(model)


def test_a_request_with_no_answer_is_said_in_words_not_the_sockets() -> None:
    with socket.socket() as closed:  # a port that was free a moment ago: nothing listens
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=5)
    said = no_answer_cause(refused.value, 5)
    assert said == "nothing listens there (the server exited, or was never started on that port)"
    timed_out = urllib.error.URLError(TimeoutError("timed out"))
    assert no_answer_cause(timed_out, 2.5) == (
        "nothing came back within rollout.server_timeout_s (2.5 s)"
    )
    assert no_answer_cause(ConnectionResetError(104, "Connection reset by peer"), 5) == (
        "it closed the connection mid-request (the server exited or was killed)"
    )
    unknown = urllib.error.URLError(OSError(113, "No route to host"))
    assert no_answer_cause(unknown, 5) == "no route to host"  # never "[Errno 113] ..."
