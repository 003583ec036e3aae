"""``grpo serve`` in a test: a process on a free port of 127.0.0.1, holding ``TOKEN``, with its
console read as it comes (a full pipe would stall it)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROLLOUT = {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12}
TOKEN = "a-test-token-0123456789"  # every server here holds it; every client sends it


@dataclass
class Running:
    process: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)  # its console after the start line

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def serve_command(model: Path, *args: str) -> list[str]:
    command = [sys.executable, "-m", "grpo.cli", "serve", str(model), *args]
    return command + [f"rollout.{k}={v}" for k, v in ROLLOUT.items()] + ["train.threads=1"]


def start_server(model: Path, *args: str) -> Running:
    """``grpo serve MODEL --port 0 ARGS``; its URL comes from its first line."""
    env = {**os.environ, "GRPO_SERVE_TOKEN": TOKEN}
    command = serve_command(model, "--port", "0", *args)
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        if "grpo serve:" in line:
            running = Running(server, line.rsplit(" at ", 1)[1].strip())
            threading.Thread(target=_drain, args=(running,), daemon=True).start()
            return running
        if not line and server.poll() is not None:
            break
    server.kill()
    raise AssertionError(f"grpo serve did not start: {server.stderr.read()[-2000:]}")


def _drain(running: Running) -> None:
    for line in running.process.stderr:
        running.lines.append(line)
