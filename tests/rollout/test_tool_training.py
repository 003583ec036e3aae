"""Training with tools: recipes, prompts that list the tool, resume, held-out eval, curate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from scripted_turns import (
    HERMES_LIKE,
    QUESTION,
    ScriptedEngine,
    question_file,
    run_metrics,
    tool_recipe,
)

from grpo.data import DataError
from grpo.models import load_tokenizer
from grpo.rollout.turns import PYTHON_TOOL_SCHEMA
from grpo.training.trainer import Trainer, train


@pytest.fixture(scope="module")
def hermes_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny model with a chat template that lists tools (``HERMES_LIKE``)."""
    model_dir = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = HERMES_LIKE
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _tool_prompt(tokenizer) -> str:
    """The question as the template shows it with the python tool listed."""
    user = [{"role": "user", "content": QUESTION}]
    return tokenizer.apply_chat_template(
        user, tools=[PYTHON_TOOL_SCHEMA], tokenize=False, add_generation_prompt=True
    )


def test_template_calls_show_the_tool_schema_in_every_prompt(
    tiny_config, hermes_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = hermes_model_dir
    tokenizer = load_tokenizer(model_dir)
    call = '<tool_call>{"name": "python", "arguments": {"code": "12 * 34"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, call=call)
    config = tiny_config(
        model={"name": str(model_dir)},
        data={"task": None, "path": str(question_file(tmp_path))},
        rollout={"tools": ["python"], "tool_call_format": "template", "max_new_tokens": 200},
        train={"steps": 1},
    )
    train(config, engine)
    # the prompts the engine was given: the template's tool list, the schema in it, the question
    shown = _tool_prompt(tokenizer)
    assert shown.startswith('<|system|><tools>{"type": "function", "function": {"name": "python"')
    firsts = [r.context for r in engine.requests if r.n == config.rollout.group_size]
    assert len(firsts) == config.rollout.prompts_per_step
    assert {tokenizer.decode(ids) for ids in firsts} == {shown}


def test_curate_shows_the_tool_schema_too(
    hermes_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from grpo.cli import main
    from grpo.data.prompts import PromptFormat

    rendered: list[str] = []
    render = PromptFormat.render
    monkeypatch.setattr(
        PromptFormat, "render", lambda self, *a: rendered.append(render(self, *a)) or rendered[-1]
    )
    recipe = tmp_path / "recipe.json"  # JSON is YAML
    recipe.write_text(
        json.dumps(
            {
                "model": {"name": str(hermes_model_dir), "precision": "float32"},
                "data": {"task": None, "path": str(question_file(tmp_path))},
                "rollout": {
                    "tools": ["python"],
                    "tool_call_format": "template",
                    "max_new_tokens": 8,
                },
                "rewards": {"functions": [{"name": "accuracy"}]},
                "train": {"progress": False},
            }
        )
    )
    out = tmp_path / "kept.jsonl"
    assert main(["curate", str(recipe), "--samples", "2", "--output", str(out)]) == 0
    assert len(rendered) == 4 and set(rendered) == {_tool_prompt(load_tokenizer(hermes_model_dir))}


def test_multi_turn_grpo_runs_from_a_recipe_and_resumes_exactly(
    tiny_config, scripted_model_dir: Path, tmp_path: Path
) -> None:
    straight = train(tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=2, run_name="a"))
    metrics = run_metrics(straight)
    assert metrics[0]["tools/calls_per_completion"] > 0.5
    # a replayed exchange earns 1.5 (the answer, and it matches the tool's output), others ~0
    assert metrics[0]["reward/mean"] > 0.5
    record = json.loads(
        (straight / "completions" / "step-000001.jsonl").read_text().splitlines()[0]
    )
    assert record["turns"][0]["output"] == "408"
    train(tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=1, run_name="b"))
    resumed = train(tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=2, run_name="b"))

    def strip(ms: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if "time" not in k and k != "tokens_per_s"} for m in ms]

    assert strip(run_metrics(resumed)) == strip(metrics)


def test_held_out_eval_answers_through_the_tool_loop(
    tiny_config, scripted_model_dir: Path, tmp_path: Path
) -> None:
    from grpo.eval import evaluate_config

    config = tool_recipe(tiny_config, scripted_model_dir, tmp_path, steps=1, eval_every=1)
    config.data.eval_path = config.data.path
    # `grpo eval`: the greedy answer after the call is right, and every answer called the tool
    result = evaluate_config(config, samples=1, examples=None)
    assert result["accuracy"] == 1.0 and result["tools/call_frac"] == 1.0
    # the trainer's held-out eval, at step 0 and after its step
    logged = [m for m in run_metrics(train(config)) if "eval/accuracy" in m]
    assert logged[0]["eval/accuracy"] == 1.0 and logged[0]["eval/tools/call_frac"] == 1.0


def test_a_data_column_named_turns_is_refused_in_a_tool_run(tiny_config, tmp_path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "1", "turns": 3}) + "\n")
    with pytest.raises(DataError, match="column 'turns' has the name"):
        Trainer(tiny_config(data={"path": str(data)}, rollout={"tools": ["python"]}))
    Trainer(tiny_config(data={"path": str(data)}))  # without tools it is a column like any other
