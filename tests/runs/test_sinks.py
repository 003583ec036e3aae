"""Optional metric sinks: wandb and trackio log offline when installed and are skipped when not.

The real packages are not dependencies, so each test injects a recording stand-in module.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from grpo.runs.metrics import MetricsLogger, reflection_rate, wandb_run_id


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __call__(self, name: str):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self

        return record

    def __getattr__(self, name: str):
        return self(name)


def fake_module(name: str, recorder: Recorder) -> types.ModuleType:
    module = types.ModuleType(name)
    module.init = recorder("init")
    module.log = recorder("log")
    module.finish = recorder("finish")
    return module


def test_wandb_sink_is_offline_and_forwards_steps(tmp_path: Path, monkeypatch) -> None:
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_module("wandb", recorder))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = MetricsLogger(tmp_path, ["wandb"])
    logger.log(3, {"reward/mean": 0.5})
    logger.close()
    name, _, init = recorder.calls[0]
    assert name == "init" and init["mode"] == "offline" and init["dir"] == str(tmp_path)
    assert init["id"] == wandb_run_id(tmp_path) and init["resume"] == "allow"
    assert ("log", ({"reward/mean": 0.5},), {"step": 3}) in recorder.calls
    assert recorder.calls[-1][0] == "finish"
    # jsonl is always on as well
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3, "reward/mean": 0.5}\n'


def test_wandb_mode_from_the_environment_wins(tmp_path: Path, monkeypatch) -> None:
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_module("wandb", recorder))
    monkeypatch.setenv("WANDB_MODE", "online")
    MetricsLogger(tmp_path, ["wandb"]).close()
    assert recorder.calls[0][2]["mode"] == "online"


def test_trackio_sink_stays_local(tmp_path: Path, monkeypatch) -> None:
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "trackio", fake_module("trackio", recorder))
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    logger = MetricsLogger(tmp_path, ["trackio"])
    logger.log(1, {"kl": 0.01})
    logger.close()

    assert os.environ["TRACKIO_DIR"] == str(tmp_path / "trackio")
    name, _, init = recorder.calls[0]
    assert name == "init" and init["project"] == "grpo" and "space_id" not in init
    assert ("log", ({"kl": 0.01},), {"step": 1}) in recorder.calls


@pytest.mark.parametrize("sink", ["wandb", "trackio"])
def test_missing_optional_sink_is_skipped(tmp_path: Path, monkeypatch, capsys, sink: str) -> None:
    monkeypatch.setitem(sys.modules, sink, None)  # makes `import sink` raise ImportError
    logger = MetricsLogger(tmp_path, [sink])
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert f"metrics sink '{sink}' skipped" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").is_file()


def test_unknown_sink_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown sink 'mlflow'"):
        MetricsLogger(tmp_path, ["mlflow"])


def test_reflection_rate() -> None:
    completions = [
        "Wait, 3 + 4 is 7",  # yes
        "let me double-check: 7",  # yes
        "awaiting the result",  # no: "wait" inside a word
        "Let me re-check this",  # yes
        "7",  # no
        "Hmm, 7",  # yes
    ]
    assert reflection_rate(completions) == pytest.approx(4 / 6, abs=1e-12)
    assert reflection_rate([]) == 0.0
