"""User data: formats, chat-message prompts, malformed rows, unparseable gold answers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from grpo.build import Given, training_rows
from grpo.config import DataConfig, build_config
from grpo.data import DataError, heldout_rows, load_dataset_rows, parse_gold


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_messages_and_plain_prompts(tmp_path: Path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = _jsonl(
        tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": 2}, {"prompt": messages, "answer": "4"}]
    )
    rows = load_dataset_rows(DataConfig(path=str(path)), seed=0)
    assert [r["prompt"] for r in rows] == ["1+1?", messages]
    assert [r["answer"] for r in rows] == ["2", "4"]


def test_csv_messages_as_json(tmp_path: Path):
    path = tmp_path / "d.csv"
    path.write_text('question,gold\n"[{""role"": ""user"", ""content"": ""hi""}]",5\n')
    rows = load_dataset_rows(
        DataConfig(path=str(path), prompt_field="question", answer_field="gold"), seed=0
    )
    assert rows[0]["prompt"] == [{"role": "user", "content": "hi"}] and rows[0]["answer"] == "5"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "x"}, "row 2 has no 'prompt'"),
        ({"prompt": [{"role": "user"}]}, "row 2 field 'prompt' must be a string or chat messages"),
        ({"prompt": 7}, "row 2 field 'prompt'"),
    ],
)
def test_malformed_row_names_file_and_row(tmp_path: Path, row: dict, message: str):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(DataError, match=message) as err:
        load_dataset_rows(DataConfig(path=str(path)), seed=0)
    assert str(path) in str(err.value)


def test_invalid_json_line(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DataError, match="row 2 is not valid JSON"):
        load_dataset_rows(DataConfig(path=str(path)), seed=0)


def test_unparseable_gold_rows_are_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    rows = [
        {"prompt": "a", "answer": "1"},
        {"prompt": "b", "answer": ""},
        {"prompt": "c"},
        {"prompt": "d", "answer": [1, 2]},
        {"prompt": "e", "answer": "work\n#### 42"},
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="grpo.data"):
        loaded = load_dataset_rows(DataConfig(path=str(path)), seed=0)
    assert [r["prompt"] for r in loaded] == ["a", "e"]
    assert loaded[1]["answer"] == "42"
    assert loaded.skipped == 3
    assert "skipped 3 of 5 rows" in caplog.text and "rows 2, 3, 4" in caplog.text


def test_no_answer_column_means_no_skipping(tmp_path: Path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert len(load_dataset_rows(DataConfig(path=str(path)), seed=0)) == 2


def test_parse_gold():
    assert parse_gold(3) == "3" and parse_gold(" 7 ") == "7"
    assert parse_gold(None) is None and parse_gold({"a": 1}) is None and parse_gold(True) is None


def test_task_split_and_args_errors():
    with pytest.raises(DataError, match="splits test, not 'train'"):
        load_dataset_rows(DataConfig(task="math500"), seed=0)
    with pytest.raises(DataError, match=r"bad data\.task_args"):
        load_dataset_rows(DataConfig(task="countdown", task_args={"colour": "red"}), seed=0)
    rows = load_dataset_rows(DataConfig(task="countdown", task_args={"size": 3}), seed=0)
    assert len(rows) == 3 and rows.skipped == 0


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("latin.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', "line 2 is not UTF-8 text"),
        ("latin.csv", b"prompt\nok\ncaf\xe9\n", "line 3 is not UTF-8 text"),
        ("ragged.csv", b"prompt,answer\na,1\nb,2,extra\n", "row 2 has more cells than the header"),
        ("broken.parquet", b"PAR1 not really parquet", "not a readable Parquet file"),
        ("array.json", b'[{"prompt": "a"}, 7]', "row 2 is not a JSON object"),
        ("taken.jsonl", b'{"prompt": "a", "completions": 1}\n', "column 'completions' has the"),
    ],
)
def test_files_that_cannot_be_read_are_one_line_naming_file_and_row(
    tmp_path: Path, name: str, content: bytes, message: str
):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        load_dataset_rows(DataConfig(path=str(path)), seed=0)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_line_separator_inside_a_json_string_is_no_line_end(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\n")
    assert load_dataset_rows(DataConfig(path=str(path)), 0)[0]["prompt"] == "a\u2028b\x85c"


def test_a_byte_order_mark_and_a_json_array_read_as_their_rows(tmp_path: Path):
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfprompt,answer\nWhat is 1 + 1?,2\n")
    array = tmp_path / "rows.json"
    array.write_text(
        json.dumps([{"prompt": "p", "answer": 3}, {"prompt": "q", "answer": 4}], indent=2)
    )
    assert [r["prompt"] for r in load_dataset_rows(DataConfig(path=str(bom)), 0)] == [
        "What is 1 + 1?"
    ]
    assert [r["answer"] for r in load_dataset_rows(DataConfig(path=str(array)), 0)] == ["3", "4"]


def _train_and_held_out(tmp_path: Path, **data: object) -> DataConfig:
    """Training rows asking 1+1 .. 4+4 (4+4 twice); held-out rows asking 3+3 .. 6+6 and a
    repeat of 6+6, one of them as chat messages equal to a training prompt."""
    chat = [{"role": "user", "content": "2+2?"}]
    train = [{"prompt": f"{n}+{n}?", "answer": 2 * n} for n in (1, 2, 3, 4, 4)]
    held = [{"prompt": f"{n}+{n}?", "answer": 2 * n} for n in (3, 4, 5, 6, 6)]
    train.append({"prompt": chat, "answer": 4})
    held.insert(1, {"prompt": chat, "answer": 4})
    return DataConfig(
        path=str(_jsonl(tmp_path / "train.jsonl", train)),
        eval_path=str(_jsonl(tmp_path / "held.jsonl", held)),
        **data,
    )


def test_eval_unseen_keeps_each_question_no_training_row_asks_once(tmp_path: Path, caplog):
    config = _train_and_held_out(tmp_path, eval_unseen=True)
    with caplog.at_level(logging.WARNING):
        rows = heldout_rows(config, seed=0)
    assert [r["prompt"] for r in rows] == ["5+5?", "6+6?"]
    assert rows.numbers == [4, 5]  # the file's row numbers travel with them
    assert "data.eval_unseen: 2 of 6 held-out rows ask a question no training row asks" in (
        caplog.text
    )
    assert [r["prompt"] for r in heldout_rows(config, seed=0, examples=1)] == ["5+5?"]
    # off: every held-out row, as before
    assert len(heldout_rows(config.model_copy(update={"eval_unseen": False}), seed=0)) == 6
    # fewer training rows leave more questions unseen
    fewer = config.model_copy(update={"num_examples": 3})  # 1+1, 2+2, 3+3
    unseen = [r["prompt"] for r in heldout_rows(fewer, seed=0)]
    assert unseen == [[{"role": "user", "content": "2+2?"}], "4+4?", "5+5?", "6+6?"]


def test_eval_unseen_with_every_question_seen_is_one_line(tmp_path: Path):
    config = _train_and_held_out(tmp_path, eval_unseen=True)
    config = config.model_copy(update={"eval_path": config.path})
    with pytest.raises(DataError, match=r"^data.eval_unseen: each of the 6 held-out rows asks a"):
        heldout_rows(config, seed=0)


def test_a_run_says_how_many_held_out_rows_repeat_training_questions(tmp_path: Path, capsys):
    tree = {"model": {"name": "m"}, "train": {"eval_every": 1, "eval_examples": 100}}
    config = build_config({**tree, "data": _train_and_held_out(tmp_path).model_dump()})
    _, held_out = training_rows(config, Given())
    assert len(held_out) == 6
    assert capsys.readouterr().err == (
        "held-out: 3 of 6 rows ask a question a training row also asks "
        "(data.eval_unseen: true leaves them out)\n"
    )
    unseen = config.model_copy(
        update={"data": config.data.model_copy(update={"eval_unseen": True})}
    )
    assert len(training_rows(unseen, Given())[1]) == 2
    assert "held-out:" not in capsys.readouterr().err
    # rows a caller gives are kept to unseen questions the same way, held-out or training ones
    given = Given(eval_rows=heldout_rows(config.data, seed=0))
    assert [r["prompt"] for r in training_rows(unseen, given)[1]] == ["5+5?", "6+6?"]
    trained = Given(rows=load_dataset_rows(config.data.model_copy(update={"num_examples": 1}), 0))
    asked = [r["prompt"] for r in training_rows(unseen, trained)[1]]  # only 1+1 was trained on
    assert asked == ["3+3?", [{"role": "user", "content": "2+2?"}], "4+4?", "5+5?", "6+6?"]


def test_rows_an_environment_plays_differ_by_any_column(tmp_path: Path, capsys):
    # one prompt starts every game, a seed column picks it: held-out games are not training
    # games, though the prompt is the same; without an environment the seed changes nothing
    games = [{"prompt": "New game: guess my number.", "seed": s} for s in range(3)]
    data = {
        "path": str(_jsonl(tmp_path / "train.jsonl", games)),
        "eval_path": str(
            _jsonl(tmp_path / "held.jsonl", [{**g, "seed": 10 + i} for i, g in enumerate(games)])
        ),
        "eval_unseen": True,
    }
    tree = {"model": {"name": "m"}, "data": data, "train": {"eval_every": 1}}
    played = build_config({**tree, "rollout": {"environment": "games.py:Game"}})
    assert [r["seed"] for r in training_rows(played, Given())[1]] == [10, 11, 12]
    with pytest.raises(DataError, match="each of the 3 held-out rows asks"):
        training_rows(build_config(tree), Given())
    plain = build_config({**tree, "data": {**data, "eval_unseen": False}})
    training_rows(plain, Given())
    assert "held-out: 3 of 3 rows ask a question" in capsys.readouterr().err
