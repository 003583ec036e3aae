"""grpo.train with parts the caller holds (reward callables, a dataset, a model, a tokenizer), as
TRL's GRPOTrainer takes them, and the resume fingerprints that refuse a silent change."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import grpo
from grpo.config import ConfigError
from grpo.data import DataError
from grpo.models import load_tokenizer
from grpo.training.caller_parts import class_digest, given_parts, source_digest, spec_name

CALLS: list[dict] = []


def lowercase_share(completions, **columns):
    """Pays the share of lowercase letters: the random tiny model moves it."""
    CALLS.append({"n": len(completions), **{k: list(v) for k, v in columns.items()}})
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]


def _rows(n: int = 16) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 3} for i in range(n)]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_with_a_callable_a_dataset_a_model_and_its_tokenizer(
    tiny_config, tiny_model_dir: Path, weights
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    before = weights.of(model)
    CALLS.clear()
    run = grpo.train(
        tiny_config(train={"steps": 2}),
        rewards=[lowercase_share],
        dataset=_rows(),
        model=model,
        tokenizer=tokenizer,
    )
    weights.assert_moved(before, weights.of(run / "final"))
    weights.assert_moved(before, weights.of(model))  # the caller's model is the policy
    # one call per step with every completion (P * G = 8) and the dataset's own columns
    assert [c["n"] for c in CALLS] == [8, 8]
    assert set(CALLS[0]) >= {"prompts", "completion_ids", "answer", "level"}
    assert all(
        str(int(p.split()[2]) + 1) == a
        for p, a in zip(CALLS[0]["prompts"], CALLS[0]["answer"], strict=True)
    )
    logged = _metrics(run)
    assert "reward/lowercase_share/mean" in logged[-1] and "reward/format/mean" not in logged[-1]
    saved = (run / "config.yaml").read_text()
    assert spec_name(lowercase_share) in saved and "task: null" in saved


def test_a_datasets_dataset_and_a_held_out_one(tiny_config) -> None:
    datasets = pytest.importorskip("datasets")
    CALLS.clear()
    run = grpo.train(
        tiny_config(train={"steps": 1, "eval_every": 1, "eval_examples": 2}),
        rewards=[lowercase_share, "format"],
        dataset=datasets.Dataset.from_list(_rows()),
        eval_dataset=_rows(3),
    )
    evals = [m for m in _metrics(run) if "eval/examples" in m]
    assert [m["eval/examples"] for m in evals] == [2.0, 2.0]  # baseline and step 1
    assert "eval/accuracy" in evals[0]  # judged by accuracy on the rows' answers


def test_bad_parts_are_one_line(tiny_config) -> None:
    with pytest.raises(DataError, match=r"dataset: a datasets\.Dataset or a list of dicts"):
        grpo.train(tiny_config(), dataset="rows.jsonl")
    with pytest.raises(DataError, match="eval_every needs held-out rows"):
        grpo.train(tiny_config(train={"eval_every": 1}), dataset=_rows())
    with pytest.raises(DataError, match="dataset: row 3 has no 'prompt' field"):
        grpo.train(tiny_config(), dataset=[*_rows(2), {"question": "no prompt"}])
    with pytest.raises(DataError, match="dataset: row 2 is a str, not a dict"):
        grpo.train(tiny_config(), dataset=[*_rows(1), "What is 1 + 1?"])
    with pytest.raises(ConfigError, match="rewards: a callable"):
        grpo.train(tiny_config(), rewards=[3])


def test_resume_refuses_a_changed_callable_or_dataset(tiny_config) -> None:
    def again(completions, **columns):
        return [0.0] * len(completions)

    config = tiny_config(train={"steps": 1, "save_every": 1})
    grpo.train(config, rewards=[lowercase_share], dataset=_rows())
    longer = tiny_config(train={"steps": 2, "save_every": 1})
    # the same qualified name, other code: refused, and the line names what changed
    again.__qualname__, again.__module__ = lowercase_share.__qualname__, __name__
    assert source_digest(again) != source_digest(lowercase_share)
    with pytest.raises(ConfigError, match="reward callables' source"):
        grpo.train(longer, rewards=[again], dataset=_rows())
    with pytest.raises(ConfigError, match="data's rows"):
        grpo.train(longer, rewards=[lowercase_share], dataset=_rows(17))
    # the same parts resume and train on
    run = grpo.train(longer, rewards=[lowercase_share], dataset=_rows())
    assert [m["step"] for m in _metrics(run) if "event" not in m] == [1, 2]


def test_data_num_examples_cuts_a_given_dataset_not_the_held_out_one(tiny_config) -> None:
    config, given = given_parts(
        tiny_config(data={"num_examples": 3}), dataset=_rows(), eval_dataset=_rows(5)
    )
    assert [r["answer"] for r in given.rows] == ["1", "2", "3"] and len(given.eval_rows) == 5
    assert config.data.task is None and config.data.path is None


def test_a_rerun_with_the_trained_model_object_is_refused_with_the_reason(
    tiny_config, tiny_model_dir: Path
) -> None:
    # grpo.train trains the model it is given in place: passing the same object again would
    # make its trained weights the KL reference; the model as first loaded resumes
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    grpo.train(tiny_config(train={"steps": 1, "save_every": 1}), model=model)
    longer = tiny_config(train={"steps": 2, "save_every": 1})
    with pytest.raises(ConfigError, match=r"the given model.s weights .*pass the model as first"):
        grpo.train(longer, model=model)
    run = grpo.train(longer, model=AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert [m["step"] for m in _metrics(run) if "event" not in m] == [1, 2]


def test_callable_fingerprints_see_what_a_closure_or_partial_holds() -> None:
    import functools

    def make(k):
        def paid(completions, **columns):
            return [k] * len(completions)

        return paid

    assert source_digest(make(1)) != source_digest(make(2))
    assert source_digest(make(1)) == source_digest(make(1))
    one, two = (functools.partial(lowercase_share, k=k) for k in (1, 2))
    assert source_digest(one) != source_digest(two)
    assert spec_name(one) == spec_name(lowercase_share)


def test_a_class_without_source_is_fingerprinted_by_its_code_and_constants() -> None:
    # a class made where no source is kept (exec, a notebook cell whose file is gone): a changed
    # constant changes what the environment does, so a resume must see it
    def make(limit: int, words: set[str]) -> type:
        scope: dict = {}
        body = f"class Game:\n    LIMIT = {limit}\n    WORDS = {words!r}\n    LOCK = object()\n"
        exec(body + "    def reset(self, **row):\n        return str(self.LIMIT)\n", scope)
        return scope["Game"]

    with pytest.raises((OSError, TypeError)):  # no source to read
        inspect.getsource(make(3, {"a"}))
    assert class_digest(make(3, {"a", "b"})) == class_digest(make(3, {"b", "a"}))
    assert class_digest(make(3, {"a"})) != class_digest(make(4, {"a"}))
    assert class_digest(make(3, {"a"})) != class_digest(make(3, {"b"}))
