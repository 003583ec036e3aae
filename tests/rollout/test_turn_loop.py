"""The multi-turn loop over scripted engines: which turns it asks for, with what seeds and
budgets, which calls it runs, and the completion and loss mask it assembles."""

from __future__ import annotations

import pytest
import torch
from scripted_turns import ANSWER, CALL, HERMES_LIKE, QUESTION, ScriptedEngine, rollout_config

from grpo.config import ConfigError, RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout import release, render_prompt
from grpo.rollout.tools import PythonTool
from grpo.rollout.turns import (
    MultiTurnEngine,
    Trajectory,
    TurnRequest,
    TurnSample,
    tool_metrics,
    turn_seed,
)


def test_turn_loop_runs_the_call_and_masks_the_observation(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, rollout_config())
    prompt = render_prompt(tokenizer, QUESTION, None)
    rollout = engine.generate([prompt], [{"answer": "408"}], 2, seeds=[7])
    call_ids = tokenizer(CALL, add_special_tokens=False).input_ids
    shown = tokenizer("<|end|><|tool|>408<|end|><|assistant|>", add_special_tokens=False).input_ids
    answer_ids = [*tokenizer(ANSWER, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    expected = call_ids + shown + answer_ids
    for i in range(2):
        n = int(rollout.completion_mask[i].sum())
        assert rollout.completion_ids[i, :n].tolist() == expected
        # the loss mask is False exactly on the observation (tool output and template tokens)
        own = [True] * len(call_ids) + [False] * len(shown) + [True] * len(answer_ids)
        assert rollout.sampled_mask[i, :n].tolist() == own
        assert rollout.loss_mask[i].sum() == len(call_ids) + len(answer_ids)
    assert rollout.answers == [ANSWER, ANSWER]
    turns = rollout.turns[0]
    assert [t["call"] for t in turns] == ["print(12*34)\n", None]
    assert turns[0]["output"] == "408" and turns[0]["error"] is None
    assert not rollout.truncated.any()
    metrics = tool_metrics(rollout.turns)
    assert metrics["tools/calls_per_completion"] == 1.0
    assert metrics["tools/turns_per_completion"] == 2.0
    assert metrics["tools/error_rate"] == 0.0


def test_the_turn_loop_pushes_the_trainers_weights_to_its_engine(tiny_model_dir) -> None:
    scripted = ScriptedEngine(load_tokenizer(tiny_model_dir))
    policy = torch.nn.Linear(1, 1)
    MultiTurnEngine(scripted, scripted.tokenizer, rollout_config()).sync_weights(policy)
    assert scripted.synced is policy


def test_closing_the_turn_loop_closes_its_engine(tiny_model_dir) -> None:
    # release calls an engine's close where it has one (vLLM's engine core must go before
    # the process group it joined); the turn loop passes its own close on to its engine
    scripted = ScriptedEngine(load_tokenizer(tiny_model_dir))
    closed: list[object] = []
    scripted.close = lambda: closed.append(scripted)
    MultiTurnEngine(scripted, scripted.tokenizer, rollout_config()).close()
    release(object())  # no close: nothing to do, no error
    assert closed == [scripted]


def test_greedy_eval_gives_each_prompt_one_completion_in_batches(tiny_model_dir) -> None:
    from grpo.data.stream import sampling_seed
    from grpo.eval import EvalSettings, generate

    scripted = ScriptedEngine(load_tokenizer(tiny_model_dir))
    engine = MultiTurnEngine(scripted, scripted.tokenizer, rollout_config())
    rollout = generate(engine, ["a", "b", "c"], [{}] * 3, 1, True, EvalSettings(batch_size=2))
    assert rollout.answers == [ANSWER] * 3
    assert [[t["output"] for t in c] for c in rollout.turns] == [["408", None]] * 3
    # batches of 2 then 1 prompt: the batch's call turns (each prompt's eval seed), then its
    # answer turns (the seed of turn 1 of member 0), one sample each
    seeds = [sampling_seed(0, i) for i in range(3)]
    first = [(1, s) for s in seeds]
    later = [(1, turn_seed(s, 0, 1)) for s in seeds]
    expected = [first[0], first[1], later[0], later[1], first[2], later[2]]
    assert [(r.n, r.seed) for r in scripted.requests] == expected


def test_later_turns_are_seeded_by_prompt_seed_member_and_request(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    scripted = ScriptedEngine(tokenizer)
    engine = MultiTurnEngine(scripted, tokenizer, rollout_config())
    engine.generate(["a", "b"], [{}, {}], 2, seeds=[5, 9])
    first, later = scripted.requests[:2], scripted.requests[2:]
    assert [(r.n, r.seed) for r in first] == [(2, 5), (2, 9)]
    assert [r.seed for r in later] == [turn_seed(s, m, 1) for s in (5, 9) for m in (0, 1)]
    assert len({turn_seed(5, m, k) for m in range(4) for k in range(4)}) == 16


def test_a_failing_call_is_shown_as_an_error_and_the_rollout_goes_on(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    scripted = ScriptedEngine(tokenizer, code="import time\ntime.sleep(60)")
    engine = MultiTurnEngine(scripted, tokenizer, rollout_config(tool_timeout_s=1))
    rollout = engine.generate(["q"], [{}], 2, seeds=[0])
    assert rollout.turns[0][0]["error"] == "timed out after 1 s"
    assert rollout.answers[0] == "<answer>Error: timed out after 1 s</answer>"
    assert tool_metrics(rollout.turns)["tools/error_rate"] == 1.0


def test_max_turns_and_the_token_budget_end_a_completion(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    one_turn = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, rollout_config(max_turns=1))
    rollout = one_turn.generate(["q"], [{}], 2, seeds=[0])
    # the last allowed turn is a call: it is not run, the completion ends there
    assert [len(t) for t in rollout.turns] == [1, 1]
    assert rollout.turns[0][0]["call"] == "print(12*34)\n" and rollout.turns[0][0]["time_s"] is None
    assert not rollout.truncated.any()
    call_len = len(tokenizer(CALL, add_special_tokens=False).input_ids)
    # room for the call and part of the observation only: truncated, never past the budget
    tight = RolloutConfig(tools=["python"], group_size=2, max_new_tokens=call_len + 5)
    rollout = MultiTurnEngine(ScriptedEngine(tokenizer), tokenizer, tight).generate(
        ["q"], [{}], 2, seeds=[0]
    )
    assert rollout.completion_mask.sum(dim=1).tolist() == [call_len + 5] * 2
    assert rollout.truncated.all()
    assert rollout.loss_mask.sum(dim=1).tolist() == [call_len] * 2


class ReplyEngine:
    """Replies from a script: the k-th batch of requests gets ``replies[k]`` (the last one
    repeated), cut to each request's token budget; "<|end|>" is its EOS. Records every request
    with the greedy flag and temperature it came with."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.eos = [tokenizer.convert_tokens_to_ids("<|end|>")]
        self.replies = replies
        self.batches = 0
        self.requests: list[tuple[TurnRequest, bool, float | None]] = []

    def sync_weights(self, model) -> None:
        pass

    def generate_turns(self, requests, stop, greedy=False, temperature=None):
        reply = self.replies[min(self.batches, len(self.replies) - 1)]
        self.batches += 1
        ids = self.tokenizer(reply, add_special_tokens=False).input_ids
        self.requests += [(r, greedy, temperature) for r in requests]
        return [[TurnSample(ids[: r.max_tokens]) for _ in range(r.n)] for r in requests]


END = "<|end|>"


NO_CALL = "```text\nhi\n```\n"  # ends at the fence's stop string, yet is no python call


def _turn(text: str, call=None, output=None, error=None, time_s=None) -> dict:
    return {"text": text, "call": call, "output": output, "error": error, "time_s": time_s}


def _run(tokenizer, replies: list[str], seeds=(3,), **config):
    scripted = ReplyEngine(tokenizer, replies)
    engine = MultiTurnEngine(scripted, tokenizer, rollout_config(**config))
    rollout = engine.generate(["q"] * len(seeds), [{}] * len(seeds), 1, seeds=list(seeds))
    return rollout, scripted.requests


def test_a_stop_string_that_closes_no_call_continues_the_turn(tiny_model_dir) -> None:
    # the turn goes on (however short its pieces) until EOS; its text is every piece
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout, requests = _run(tokenizer, [NO_CALL, "x", ANSWER + END])
    assert rollout.turns == [[_turn(NO_CALL + "x" + ANSWER)]]
    # later requests are seeded by the request count: 1, then 2
    assert [r.seed for r, *_ in requests] == [3, turn_seed(3, 0, 1), turn_seed(3, 0, 2)]
    sizes = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in (NO_CALL, "x")]
    assert [r.max_tokens for r, *_ in requests] == [200, 200 - sizes[0], 200 - sum(sizes)]
    assert not rollout.truncated.any()


def test_an_empty_turn_ends_the_completion(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout, requests = _run(tokenizer, ["", ANSWER + END])
    assert len(requests) == 1 and rollout.turns == [[_turn("")]]
    assert not rollout.truncated.any()


def test_greedy_temperature_and_drawn_seeds_reach_every_request(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    scripted = ReplyEngine(tokenizer, [NO_CALL, ANSWER + END])
    engine = MultiTurnEngine(scripted, tokenizer, rollout_config())
    rollout = engine.generate(["q"] * 8, [{}] * 8, 1, temperature=0.7, greedy=True)  # seeds drawn
    assert rollout.decoding.temperature == 0.7  # recorded as sampled
    assert len(scripted.requests) == 16
    assert all(greedy is True and t == 0.7 for _, greedy, t in scripted.requests)
    seeds = [r.seed for r, *_ in scripted.requests[:8]]
    # 62-bit seeds, as turn_seed's; 8 draws below 2**32 would be a 1 in 2**240 event
    assert all(0 <= s < 2**62 for s in seeds) and max(seeds) >= 2**32
    assert [r.seed for r, *_ in scripted.requests[8:]] == [turn_seed(s, 0, 1) for s in seeds]
    with pytest.raises(ValueError):  # one seed per prompt
        engine.generate(["q", "q"], [{}, {}], 1, seeds=[1])


def test_turn_seeds_are_pinned() -> None:
    # a function of (seed, member, request) only: the same numbers on every machine and version
    assert turn_seed(0, 0, 1) == 161281735863300736
    assert turn_seed(5, 1, 2) == 4373636395895995945


def test_sampler_logprobs_hold_only_when_every_sampled_piece_had_them() -> None:
    path = Trajectory()
    path.add([1, 2], True, [-0.1, -0.2])
    path.add([3], False)  # an observation needs none
    assert path.sampler_logprobs
    path.add([4], True)  # a sampled piece without log-probs
    path.add([5], True, [-0.3])
    assert not path.sampler_logprobs


def test_the_token_budget_and_max_turns_decide_whether_a_call_runs(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    size = len(tokenizer(CALL, add_special_tokens=False).input_ids)
    code = "print(12*34)\n"
    # the call fills the budget: no room for its output, it does not run; cut by length
    rollout, _ = _run(tokenizer, [CALL], max_new_tokens=size)
    assert rollout.turns == [[_turn(CALL, call=code)]] and rollout.truncated.all()
    # one token of room: it runs, its output is cut to that token, cut by length
    rollout, _ = _run(tokenizer, [CALL], max_new_tokens=size + 1)
    assert rollout.turns[0][0]["output"] == "408" and rollout.truncated.all()
    assert int(rollout.completion_mask.sum()) == size + 1
    # max_turns = 1: the call cannot run (its output would need a second turn); not truncated
    rollout, _ = _run(tokenizer, [CALL], max_new_tokens=size + 1, max_turns=1)
    assert rollout.turns == [[_turn(CALL, call=code)]] and not rollout.truncated.any()
    # max_turns = 2: a call and the answer
    rollout, _ = _run(tokenizer, [CALL, ANSWER + END], max_turns=2)
    assert [t["output"] for t in rollout.turns[0]] == ["408", None]
    metrics = tool_metrics(rollout.turns)
    assert metrics["tools/time_s"] == rollout.turns[0][0]["time_s"] > 0  # the call's run time
    # a turn that is no call with one token of room left goes on, with a budget of one token
    size = len(tokenizer(NO_CALL, add_special_tokens=False).input_ids)
    rollout, requests = _run(tokenizer, [NO_CALL, ANSWER + END], max_new_tokens=size + 1)
    assert [r.max_tokens for r, *_ in requests] == [size + 1, 1] and rollout.truncated.all()


def test_a_call_that_cannot_run_answers_with_its_error(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = HERMES_LIKE
    web = '<tool_call>{"name": "web", "arguments": {"code": "x"}}</tool_call>'
    rollout, requests = _run(tokenizer, [web, ANSWER + END], tool_call_format="template")
    error = "unknown tool 'web' (tools: python)"
    assert rollout.turns == [
        [_turn(web, output="", error=error, time_s=0.0), _turn(ANSWER)]
    ]  # nothing ran: no output, no time
    seen = tokenizer.decode(requests[1][0].context)
    assert seen.endswith(f"<|tool|>Error: {error}<|end|><|assistant|>")
    assert tool_metrics(rollout.turns)["tools/error_rate"] == 1.0


def test_the_models_eos_closes_its_message_before_the_tool_output(tiny_model_dir) -> None:
    # the template's tool message starts by closing the assistant message ("<|end|>"): when
    # the model's own EOS closed it, that text is not added a second time
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    block = "```python\nprint(12*34)\n```"
    for call, shown in [(block + END, "<|tool|>408"), (CALL, "<|end|><|tool|>408")]:
        rollout, _ = _run(tokenizer, [call, ANSWER + END])
        n = int(rollout.completion_mask[0].sum())
        observation = ids(shown + "<|end|><|assistant|>")
        expected = ids(call) + observation + ids(ANSWER + END)
        assert rollout.completion_ids[0, :n].tolist() == expected


def test_a_tokenizer_that_adds_bos_adds_none_to_prompts_or_tool_output(tiny_model_dir) -> None:
    # Llama's and gemma's tokenizers prepend BOS; the rendered prompt already holds it and a
    # tool observation sits mid-sequence: neither is tokenized with special tokens
    from tokenizers.processors import TemplateProcessing

    tokenizer = load_tokenizer(tiny_model_dir)
    bos = tokenizer.convert_tokens_to_ids("<|system|>")  # stands in for a BOS token
    single = TemplateProcessing(single="<|system|> $A", special_tokens=[("<|system|>", bos)])
    tokenizer.backend_tokenizer.post_processor = single
    assert tokenizer("q").input_ids[0] == bos
    rollout, requests = _run(tokenizer, [CALL, ANSWER + END])
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    assert requests[0][0].context == ids("q")
    n = int(rollout.completion_mask[0].sum())
    shown = ids("<|end|><|tool|>408<|end|><|assistant|>")
    assert rollout.completion_ids[0, :n].tolist() == ids(CALL) + shown + ids(ANSWER + END)


def test_an_engine_that_cannot_take_turns_is_a_config_error(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(ConfigError) as raised:
        MultiTurnEngine(object(), tokenizer, rollout_config())
    assert str(raised.value) == "rollout.tools: this rollout engine cannot take turns"


def test_the_tool_runs_with_the_configured_limits(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    config = rollout_config(tool_timeout_s=3, tool_max_output_chars=50)
    engine = MultiTurnEngine(ReplyEngine(tokenizer, [END]), tokenizer, config)
    assert engine.tool == PythonTool(timeout_s=3, max_output_chars=50)


def test_completions_are_as_wide_as_the_longest_and_without_sampler_logprobs(
    tiny_model_dir,
) -> None:
    # every completion is the EOS alone: one column; the engine reports no log-probs: none
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout, _ = _run(tokenizer, [END], seeds=(3, 4))
    eos = tokenizer.convert_tokens_to_ids(END)
    assert rollout.completion_ids.tolist() == [[eos], [eos]]
    assert rollout.sampler_logp is None


def test_an_observation_that_fills_the_budget_ends_the_completion(tiny_model_dir) -> None:
    # the call and its output use every token: no request for an answer, cut by length
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    shown = ids("<|end|><|tool|>408<|end|><|assistant|>")
    budget = len(ids(CALL)) + len(shown)
    rollout, requests = _run(tokenizer, [CALL, ANSWER + END], max_new_tokens=budget)
    assert len(requests) == 1
    assert [(t["call"], t["output"]) for t in rollout.turns[0]] == [("print(12*34)\n", "408")]
    assert rollout.truncated.all() and int(rollout.completion_mask.sum()) == budget
