"""The real wandb and trackio packages (the `sinks` extra, installed by `make test`), offline.

A short training run's metrics must arrive in wandb's offline run file and in trackio's local
SQLite database under the names metrics.jsonl uses; a sink that cannot start costs one line.
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpo.runs.metrics import MetricsLogger
from grpo.training.trainer import train

# found without importing them (see TrackioSink; wandb takes a second, paid where these run)
for _package in ("wandb", "trackio"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed", allow_module_level=True)


def wandb_records(path: Path) -> Iterator:
    """Records of a .wandb file: a 7-byte header, then LevelDB-log framed protobuf records
    (32 KiB blocks; each chunk: crc 4 bytes, length 2, type 1 = full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as wandb_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            out[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    return out


def trackio_history(run_name: str) -> dict[int, dict[str, float]]:
    """The latest trackio run of that name, from the database the sink wrote."""
    folder = Path(sys.modules["trackio"].utils.TRACKIO_DIR)
    with sqlite3.connect(folder / "grpo.db") as db:
        query = "select run_id from metrics where run_name = ? order by id desc limit 1"
        (run_id,) = db.execute(query, (run_name,)).fetchone()
        rows = db.execute("select step, metrics from metrics where run_id = ?", (run_id,))
        return {step: json.loads(metrics) for step, metrics in rows}


def test_a_short_run_reaches_wandb_offline_and_trackio(
    tiny_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    config = tiny_config(
        train={"steps": 2, "eval_every": 2, "eval_examples": 2, "sinks": ["wandb", "trackio"]}
    )
    assert "trackio" not in sys.modules  # so the sink's TRACKIO_DIR (the run dir) takes effect
    run_dir = train(config)
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = {line.pop("step"): line for line in lines}
    assert sorted(expected) == [0, 1, 2]
    for history in (wandb_history(run_dir), trackio_history(run_dir.name)):
        assert sorted(history) == [0, 1, 2]
        for step, metrics in expected.items():
            assert set(history[step]) == set(metrics)  # the documented names, none renamed
            for key, value in metrics.items():
                assert history[step][key] == pytest.approx(value, rel=1e-6, nan_ok=True)


def test_a_sink_that_cannot_start_costs_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("WANDB_MODE", "no-such-mode")  # wandb.init refuses it
    logger = MetricsLogger(tmp_path, ["wandb"])
    logger.log(1, {"loss": 1.0})
    logger.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "metrics sink" in ln]
    assert len(lines) == 1 and "metrics sink 'wandb' failed to start" in lines[0]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_a_sink_that_fails_mid_run_is_dropped_with_one_line(tmp_path: Path, capsys) -> None:
    class Broken:
        def log(self, step: int, metrics: dict[str, float]) -> None:
            raise OSError("disk quota exceeded\nmore detail")

    logger = MetricsLogger(tmp_path, [])
    logger.sinks["wandb"] = Broken()
    logger.log(1, {"loss": 1.0})
    logger.log(2, {"loss": 0.5})
    logger.close()
    out = capsys.readouterr().out.strip()
    assert out == "metrics sink 'wandb' failed at step 1, dropped: OSError: disk quota exceeded"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
