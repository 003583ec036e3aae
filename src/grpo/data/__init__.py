"""Datasets: files users bring (JSONL, Parquet, CSV, `datasets` folders) and built-in tasks.

Rows are plain dicts. After loading, every row has ``prompt`` (a string or a list of chat
messages) and, when the source has one, ``answer``; other columns pass through to the rewards.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from grpo.config import DataConfig
from grpo.data.tasks import TASKS, Task


class DataError(ValueError):
    """Data that cannot be used; the message names the file and row."""


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: row {line_no} is not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {line_no} is not a JSON object")
            rows.append(row)
    return rows


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_datasets_folder(path: Path, split: str) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(str(path))
    if isinstance(data, DatasetDict):
        if split not in data:
            raise DataError(f"{path}: no split '{split}' (has {', '.join(data)})")
        data = data[split]
    return data.to_list()


READERS = {".jsonl": _read_jsonl, ".json": _read_jsonl, ".csv": _read_csv, ".parquet": _read_parquet}


def read_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    if path.is_dir():
        return _read_datasets_folder(path, split)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unsupported data format (use {', '.join(READERS)} or a folder)")
    return reader(path)


def _valid_messages(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ) and len(value) > 0


def normalise_rows(
    rows: list[dict[str, Any]], prompt_field: str, answer_field: str, source: str
) -> list[dict[str, Any]]:
    """Map the configured fields to ``prompt``/``answer``; a bad row is an error naming it."""
    out = []
    for i, row in enumerate(rows, start=1):
        prompt = row.get(prompt_field)
        if prompt is None or prompt == "":
            raise DataError(f"{source}: row {i} has no '{prompt_field}' field")
        if not isinstance(prompt, str) and not _valid_messages(prompt):
            raise DataError(
                f"{source}: row {i} field '{prompt_field}' must be a string or chat messages"
            )
        new = dict(row)
        new["prompt"] = prompt
        if answer_field in row:
            new["answer"] = row[answer_field]
        out.append(new)
    if not out:
        raise DataError(f"{source}: no rows")
    return out


def load_dataset_rows(config: DataConfig, seed: int, split: str | None = None) -> list[dict[str, Any]]:
    """The rows a run trains (or evaluates) on."""
    split = split or config.split
    if config.path is not None:
        rows = read_rows(config.path, split)
        source = config.path
    else:
        task = get_task(config.task)
        rows = task.rows(split, seed, **config.task_args)
        source = f"task '{config.task}'"
    rows = normalise_rows(rows, config.prompt_field, config.answer_field, source)
    if config.num_examples is not None:
        rows = rows[: config.num_examples]
    return rows


def get_task(name: str | None) -> Task:
    if name not in TASKS:
        raise DataError(f"unknown task '{name}' (built-in: {', '.join(sorted(TASKS))})")
    return TASKS[name]


def system_prompt_for(config: DataConfig) -> str | None:
    if config.system_prompt is not None:
        return config.system_prompt
    if config.path is None and config.task in TASKS:
        return TASKS[config.task].system_prompt
    return None
