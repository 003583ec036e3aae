"""Datasets: files users bring (JSONL, Parquet, CSV, `datasets` folders) and built-in tasks.

Rows are plain dicts. After loading, every row has ``prompt`` (a string or a list of chat
messages) and, when the source has one, ``answer``; other columns pass through to the rewards.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.data.curriculum import Curriculum, Levels, levels_of
from grpo.data.reasoning_gym import GymError
from grpo.data.tasks import TASKS, Task

if TYPE_CHECKING:
    from grpo.config import DataConfig

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """Data that cannot be used; the message names the file and row."""


# what reward functions get besides the data's columns, which must not shadow them
REWARD_ARGUMENTS = {"completions", "prompts", "completion_ids"}


def _text(path: Path) -> str:
    """The file as UTF-8 text (a byte-order mark dropped, as pandas and datasets do)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line} is not UTF-8 text (byte {err.start})") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    text = _text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return _read_json_array(path, text)  # one JSON array of objects, not lines
    rows = []
    # JSON lines end at \n (or \r\n, \r); U+2028 and the like may stand raw inside a string
    for line_no, line in enumerate(io.StringIO(text, newline=None), start=1):
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


def _read_json_array(path: Path, text: str) -> list[dict[str, Any]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is not a JSON object")
    return rows


def _read_csv(path: Path) -> list[dict[str, Any]]:
    rows = list(csv.DictReader(io.StringIO(_text(path), newline="")))
    for i, row in enumerate(rows, start=1):
        if None in row:  # DictReader's key for cells past the header
            raise DataError(f"{path}: row {i} has more cells than the header has columns")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        said = " ".join(str(err).split())[:200]
        raise DataError(f"{path}: not a readable Parquet file ({said})") from None


def _read_datasets_folder(path: Path, split: str) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(str(path))
    if isinstance(data, DatasetDict):
        if split not in data:
            raise DataError(f"{path}: no split '{split}' (has {', '.join(data)})")
        data = data[split]
    return data.to_list()


READERS = {
    ".jsonl": _read_jsonl,
    ".json": _read_jsonl,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
}


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
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )


def _as_prompt(value: Any) -> str | list[dict[str, str]] | None:
    """A string prompt, chat messages, or None. CSV cells holding messages as JSON are decoded."""
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        return decoded if _valid_messages(decoded) else value
    if isinstance(value, str) or _valid_messages(value):
        return value
    return None


def parse_gold(value: Any) -> str | None:
    """A gold answer as a string, or None when it cannot be used (missing, empty, a container).
    GSM8K-style solutions ("... #### 18") give the text after the last '####'."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        return None
    text = str(value).strip()
    if "####" in text:
        text = text.rpartition("####")[2].strip()
    return text or None


class Rows(list):
    """Loaded rows (a list of dicts); ``skipped`` counts rows dropped for an unusable gold answer;
    ``sources[i]`` is row i as the data holds it (before field mapping), ``numbers[i]`` its
    1-based row number there."""

    skipped: int = 0
    sources: list[dict[str, Any]]
    numbers: list[int]


def normalise_rows(
    rows: list[dict[str, Any]],
    prompt_field: str,
    answer_field: str,
    source: str,
    gold_required: bool = True,
) -> Rows:
    """Map the configured fields to ``prompt``/``answer``; a malformed row is an error naming it.

    When the data has a gold-answer column, a row whose gold answer cannot be parsed is skipped
    and counted (``Rows.skipped``, and a warning) instead of failing the run; with
    ``gold_required`` False it is kept with ``answer`` None (a task whose verifier judges by rule).
    """
    has_answers = any(answer_field in row for row in rows)
    taken = sorted({key for row in rows if isinstance(row, dict) for key in row} & REWARD_ARGUMENTS)
    if taken:
        raise DataError(
            f"{source}: column '{taken[0]}' has the name of an argument every reward function "
            f"gets ({', '.join(sorted(REWARD_ARGUMENTS))}); rename it"
        )
    out = Rows()
    out.sources, out.numbers = [], []
    skipped_rows: list[int] = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{source}: row {i} is not a mapping of fields")
        raw = row.get(prompt_field)
        if raw is None or raw == "":
            raise DataError(f"{source}: row {i} has no '{prompt_field}' field")
        prompt = _as_prompt(raw)
        if prompt is None:
            raise DataError(
                f"{source}: row {i} field '{prompt_field}' must be a string or chat messages "
                "[{role, content}, ...]"
            )
        new = dict(row)
        new["prompt"] = prompt
        if has_answers:
            gold = parse_gold(row.get(answer_field))
            if gold is None and gold_required:
                skipped_rows.append(i)
                continue
            new["answer"] = gold
        out.append(new)
        out.sources.append(row)
        out.numbers.append(i)
    out.skipped = len(skipped_rows)
    if skipped_rows:
        shown = ", ".join(map(str, skipped_rows[:10])) + (" ..." if len(skipped_rows) > 10 else "")
        logger.warning(
            "%s: skipped %d of %d rows whose gold answer '%s' cannot be parsed (rows %s)",
            source,
            len(skipped_rows),
            len(rows),
            answer_field,
            shown,
        )
    if not out:
        raise DataError(f"{source}: no usable rows")
    return out


def load_dataset_rows(config: DataConfig, seed: int, split: str | None = None) -> Rows:
    """The rows a run trains (or evaluates) on."""
    split = split or config.split
    if config.path is None and config.task is None:
        raise DataError("data: set either data.task or data.path")
    if config.path is not None:
        rows = read_rows(config.path, split)
        source = config.path
    else:
        task = get_task(config.task)
        if split not in task.splits:
            raise DataError(
                f"task '{config.task}' has splits {', '.join(task.splits)}, not '{split}'"
            )
        try:
            if config.curriculum.enabled:  # the first level's rows; held-out: the top level's
                levels = curriculum_levels(config, seed)
                level = config.curriculum.start_level if split == "train" else levels.top
                rows = levels.rows(split, level, config.task_args.get("size", 1000))
            else:
                rows = task.rows(split, seed, **config.task_args)
        except TypeError as err:
            raise DataError(
                f"task '{config.task}': bad data.task_args {config.task_args}: {err}"
            ) from None
        except GymError as err:
            raise DataError(str(err)) from None
        source = f"task '{config.task}'"
    gold_required = config.path is not None or TASKS[config.task].gold_required
    rows = normalise_rows(rows, config.prompt_field, config.answer_field, source, gold_required)
    return first_rows(rows, config.num_examples)


def curriculum_levels(config: DataConfig, seed: int) -> Levels:
    """The levels of ``data.curriculum`` over a reasoning_gym task, each checked; DataError."""
    try:
        return levels_of(config.task_args, config.curriculum, seed)
    except GymError as err:
        raise DataError(str(err)) from None


def curriculum_of(config: DataConfig, seed: int) -> Curriculum | None:
    """The run's curriculum at its start level (None without ``data.curriculum``)."""
    if not config.curriculum.enabled:
        return None
    return Curriculum(config.curriculum, curriculum_levels(config, seed))


def first_rows(rows: Rows, n: int | None) -> Rows:
    """The first ``n`` rows (all when None), with their sources and row numbers."""
    if n is not None:
        for kept in (rows, rows.sources, rows.numbers):
            del kept[n:]
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


def verifier_of(config: DataConfig) -> dict[str, Any]:
    """The reward spec evaluation judges correctness by: ``data.verifier``, else the task's own,
    else ``accuracy`` with its default arguments."""
    if config.verifier is not None:
        return config.verifier.model_dump()
    if config.path is None and config.task in TASKS:
        return TASKS[config.task].verifier
    return {"name": "accuracy"}


def question(row: dict[str, Any]) -> str:
    """What a row asks, as one comparable string: its prompt and gold answer (the rest of a
    row, a generator's draw index say, does not change the question)."""
    return json.dumps([row["prompt"], row.get("answer")], sort_keys=True, default=str)


def whole_row(row: dict[str, Any]) -> str:
    """A row as one comparable string, every column: what an environment's ``reset`` gets (one
    prompt may start many games, told apart by a seed column)."""
    return json.dumps(row, sort_keys=True, default=str)


Asked = Callable[[dict[str, Any]], str]


def heldout_rows(
    config: DataConfig, seed: int, examples: int | None = None, asked_by: Asked = question
) -> Rows:
    """The first ``examples`` held-out rows: ``data.eval_path`` when set, else a task's test
    split or the 'test' split of a `datasets` folder. A single training file has none. With
    ``data.eval_unseen``, only rows that ask what no training row asks (``unseen_rows``)."""
    if config.eval_unseen:
        rows = heldout_rows(config.model_copy(update={"eval_unseen": False}), seed)
        return first_rows(unseen_rows(rows, load_dataset_rows(config, seed), asked_by), examples)
    data = config.model_copy(update={"num_examples": examples})
    if data.eval_path is not None:
        data = data.model_copy(update={"path": data.eval_path})
    elif data.path is not None and not Path(data.path).is_dir():
        raise DataError(
            f"data.path {data.path}: a single file has no held-out split for evaluation "
            "(set data.eval_path, or use a built-in task or a datasets folder with a 'test' split)"
        )
    return load_dataset_rows(data, seed, "test")


def seen_count(
    held_out: list[dict[str, Any]], training: list[dict[str, Any]], asked_by: Asked = question
) -> int:
    """How many held-out rows ask what a training row also asks (``asked_by`` says what a row
    asks: ``question``, or ``whole_row`` where an environment plays the rows)."""
    asked = {asked_by(row) for row in training}
    return sum(asked_by(row) in asked for row in held_out)


def unseen_rows(held_out: Rows, training: list[dict[str, Any]], asked_by: Asked = question) -> Rows:
    """The held-out rows that ask what no training row asks, each once (the first row that asks
    it), with their sources and row numbers; how many is said in one line, and none left is a
    DataError (``data.eval_unseen``)."""
    asked = {asked_by(row) for row in training}
    out = Rows()
    out.sources, out.numbers = [], []
    for row, source, number in zip(held_out, held_out.sources, held_out.numbers, strict=True):
        if asked_by(row) not in asked:
            asked.add(asked_by(row))
            out.append(row)
            out.sources.append(source)
            out.numbers.append(number)
    if not out:
        raise DataError(
            f"data.eval_unseen: each of the {len(held_out)} held-out rows asks a question the "
            "training rows ask (train on fewer rows: data.num_examples)"
        )
    logger.warning(
        "data.eval_unseen: %d of %d held-out rows ask a question no training row asks "
        "(each question once); the others are left out",
        len(out),
        len(held_out),
    )
    return out


def heldout_source(config: DataConfig) -> dict[str, Any]:
    """What ``heldout_rows`` reads, for reports: a file or folder, or a task's test split, and
    whether only questions no training row asks (``data.eval_unseen``)."""
    unseen = {"unseen": True} if config.eval_unseen else {}
    if config.eval_path is not None:
        return {"path": str(Path(config.eval_path).resolve()), **unseen}
    if config.path is not None:
        return {"path": str(Path(config.path).resolve()), "split": "test", **unseen}
    return {"task": config.task, "task_args": config.task_args, "split": "test", **unseen}
