"""What the multi-turn tests share: a question, its scripted two-turn exchange, engines and
recipes that replay it, and the tiny model trained to replay it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo.config import ModelConfig, RolloutConfig
from grpo.models import CHAT_TEMPLATE, load_policy, load_tokenizer
from grpo.rollout import render_prompt
from grpo.rollout.turns import TurnRequest, TurnSample, template_observation

QUESTION = "What is 12 * 34?"
# a template that lists the tools in a system message and says how to call them, as Hermes' and
# Qwen's do (their call syntax: <tool_call>{"name": ..., "arguments": ...}</tool_call>)
HERMES_LIKE = (
    "{% if tools %}<|system|><tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Call one as <tool_call>{name, arguments}</tool_call><|end|>{% endif %}" + CHAT_TEMPLATE
)
CALL = "```python\nprint(12*34)\n```\n"
ANSWER = "<answer>408</answer>"


class ScriptedEngine:
    """Takes turns from a script: the first turn of every completion writes ``CALL`` (or the
    code given), the next answers with the last tool output it sees. Records every request."""

    def __init__(self, tokenizer, code: str = "print(12*34)", call: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = [tokenizer.eos_token_id]
        self.call = call or f"```python\n{code}\n```\n"
        self.requests: list[TurnRequest] = []

    def sync_weights(self, model) -> None:
        self.synced = model

    def generate_turns(self, requests, stop, greedy=False, temperature=None):
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.tokenizer.decode(r.context, skip_special_tokens=False)
            if "<|tool|>" not in text:  # the call ends at the stop string, without EOS
                reply, end = self.call, []
            else:
                shown = text.rsplit("<|tool|>", 1)[1].split("<|end|>", 1)[0]
                reply, end = f"<answer>{shown}</answer>", self.eos
            ids = [*self.tokenizer(reply, add_special_tokens=False).input_ids, *end]
            ids = ids[: r.max_tokens]
            out.append([TurnSample(list(ids)) for _ in range(r.n)])
        return out


def rollout_config(**kw) -> RolloutConfig:
    """Python tool calls, groups of 2, 200 tokens; ``kw`` overrides any of them."""
    return RolloutConfig(**{"tools": ["python"], "group_size": 2, "max_new_tokens": 200, **kw})


def train_scripted(model_dir: Path, out: Path) -> Path:
    """The model at ``model_dir`` trained to replay: question -> CALL -> (tool output) -> ANSWER
    + EOS, saved at ``out``."""
    tokenizer = load_tokenizer(model_dir)
    model = load_policy(ModelConfig(name=str(model_dir)), str(model_dir))
    text = render_prompt(tokenizer, QUESTION, None) + CALL
    text += template_observation(tokenizer, "408") + ANSWER
    ids = torch.tensor(
        [[*tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]]
    )
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 5e-3:  # ~70 steps; the whole exchange then has probability ~0.7
            break
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def question_file(tmp_path: Path) -> Path:
    """Four rows of ``QUESTION`` with its answer, as a JSONL data file."""
    path = tmp_path / "q.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": QUESTION, "answer": "408"}) + "\n" for _ in range(4))
    )
    return path


def tool_recipe(tiny_config, scripted_model_dir: Path, tmp_path: Path, **train_args):
    """A tool run of the scripted model on ``question_file``, paid for the right answer and for
    a tool output that matches it; ``train_args`` go into the train section."""
    reward = tmp_path / "used_tool.py"
    reward.write_text(
        "def used_tool(completions, turns, answer, **kw):\n"
        "    # the final answer text and the turns arrive as keyword data\n"
        "    return [float(a in c) + 0.5 * sum(t['output'] == a for t in ts)\n"
        "            for c, ts, a in zip(completions, turns, answer)]\n"
    )
    return tiny_config(
        model={"name": str(scripted_model_dir)},
        data={"task": None, "path": str(question_file(tmp_path))},
        rollout={"tools": ["python"], "max_new_tokens": 120, "max_turns": 3},
        rewards={"functions": [{"name": f"{reward}:used_tool"}]},
        train={"save_every": 1, "log_completions": 2, **train_args},
    )


def run_metrics(run_dir: Path) -> list[dict]:
    """Each step's metrics (event rows, such as where a resume continued, left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "event" not in row]
