"""The real engines taking turns: the HF engine replays the scripted policy's exchange,
vLLM's engine goes through the same loop (scripted, and its CPU build when installed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scripted_turns import ANSWER, CALL, QUESTION, ScriptedEngine, rollout_config, train_scripted

from grpo.config import ModelConfig
from grpo.models import load_policy, load_tokenizer
from grpo.rollout import render_prompt
from grpo.rollout.hf import HFEngine
from grpo.rollout.turns import MultiTurnEngine, TurnRequest


def test_hf_engine_replays_the_scripted_exchange(scripted_model_dir: Path) -> None:
    tokenizer = load_tokenizer(scripted_model_dir)
    model = load_policy(ModelConfig(name=str(scripted_model_dir)), str(scripted_model_dir))
    config = rollout_config()
    engine = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    prompt = render_prompt(tokenizer, QUESTION, None)
    rollout = engine.generate([prompt], [{}], 2, seeds=[0], greedy=True)
    # the stop string ended turn 1 at the closing fence; the real sandbox ran the call
    assert rollout.turns[0][0]["text"] == CALL
    assert rollout.turns[0][0]["output"] == "408"
    assert rollout.answers == [ANSWER, ANSWER]
    # sampled (not greedy) completions depend on the prompt's seed only, not on the batch
    sampling = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    alone = sampling.generate([prompt], [{}], 2, seeds=[3])
    both = sampling.generate([prompt, prompt + "x"], [{}, {}], 2, seeds=[3, 4])
    n = alone.completion_ids.shape[1]
    assert torch.equal(alone.completion_ids, both.completion_ids[:2, :n])
    assert torch.equal(alone.sampled_mask, both.sampled_mask[:2, :n])


def test_a_tool_rollout_packs_the_weights_once_for_all_its_turns(scripted_model_dir, monkeypatch):
    # under bf16 the HF engine packs its linear layers per session; the turn loop holds one
    # session around its turns, so a two-turn rollout packs each layer once, not twice
    from grpo.rollout import packed_weights

    tokenizer = load_tokenizer(scripted_model_dir)
    model = load_policy(ModelConfig(name=str(scripted_model_dir)), str(scripted_model_dir))
    if not packed_weights._kernels(torch.bfloat16):
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    config = rollout_config()
    engine = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    reorder, packed = torch.ops.mkldnn._reorder_linear_weight, []
    monkeypatch.setattr(
        torch.ops.mkldnn, "_reorder_linear_weight", lambda w: packed.append(1) or reorder(w)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prompts = [render_prompt(tokenizer, QUESTION, None)]
        rollout = engine.generate(prompts, [{}], 1, seeds=[0], greedy=True)
    assert len(rollout.turns[0]) >= 2  # the call, its output, then the answer
    assert len(packed) == sum(type(m) is torch.nn.Linear for m in model.modules())


class ScriptedLLM:
    """vllm.LLM's ``generate`` over ``ScriptedEngine``'s script: each sampled token's log-prob
    is -0.5; the sampling parameters of every request are recorded."""

    def __init__(self, tokenizer) -> None:
        self.script = ScriptedEngine(tokenizer)
        self.params: list[dict] = []

    def generate(self, requests, params, use_tqdm=False):
        from types import SimpleNamespace

        out = []
        for request, p in zip(requests, params, strict=True):
            self.params.append(p)
            turn = TurnRequest(request["prompt_token_ids"], p["n"], p["seed"], p["max_tokens"])
            samples = self.script.generate_turns([turn], p["stop"])[0]
            outputs = [
                SimpleNamespace(
                    index=k,
                    token_ids=s.token_ids,
                    logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in s.token_ids],
                )
                for k, s in enumerate(samples)
            ]
            out.append(SimpleNamespace(outputs=outputs[::-1]))
        return out

    def apply_model(self, func):
        return []

    def reset_prefix_cache(self) -> None:
        pass


def test_vllm_engine_takes_turns_through_the_same_loop(tiny_model_dir) -> None:
    from grpo.rollout.vllm import VLLMEngine

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    config = rollout_config(temperature=0.8)
    llm = ScriptedLLM(tokenizer)
    vllm = VLLMEngine(model, tokenizer, config, llm=llm, sampling_params=dict)
    engine = MultiTurnEngine(vllm, tokenizer, config)
    rollout = engine.generate([render_prompt(tokenizer, QUESTION, None)], [{}], 2, seeds=[4])
    assert rollout.answers == [ANSWER, ANSWER]
    first, second = llm.params[0], llm.params[1]
    assert (first["n"], first["seed"], second["n"]) == (2, 4, 1)
    assert first["stop"] == ["```\n"] and first["include_stop_str_in_output"]
    assert first["temperature"] == 0.8 and first["stop_token_ids"] == [tokenizer.eos_token_id]
    # the sampler's log-probs on the model's tokens, 0 on the observation
    own = rollout.sampled_mask & rollout.completion_mask
    assert torch.equal(rollout.sampler_logp[own], torch.full((int(own.sum()),), -0.5))
    assert (rollout.sampler_logp[~own] == 0).all()


def test_vllm_greedy_turns_ask_for_one_sample_per_request(tiny_model_dir) -> None:
    from grpo.rollout.vllm import VLLMEngine

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    llm = ScriptedLLM(tokenizer)
    vllm = VLLMEngine(model, tokenizer, rollout_config(), llm=llm, sampling_params=dict)
    out = vllm.generate_turns([TurnRequest([5], 3, 1, 9), TurnRequest([6], 3, 2, 9)], [], True)
    assert [len(group) for group in out] == [3, 3]
    # vLLM refuses n > 1 with greedy sampling: 6 requests of n=1 at temperature 0
    assert [(p["n"], p["temperature"], p["seed"]) for p in llm.params] == [(1, 0.0, 1)] * 3 + [
        (1, 0.0, 2)
    ] * 3


@pytest.mark.slow
def test_real_vllm_replays_the_scripted_exchange(tmp_path: Path) -> None:
    """vLLM's CPU build (when installed): the same greedy turns as the HF engine."""
    pytest.importorskip("vllm")
    from grpo.models import build_tiny_model
    from grpo.rollout.vllm import VLLMEngine

    # vLLM's CPU attention takes head sizes like 64, not the tiny model's 16
    wide = build_tiny_model(tmp_path / "wide", hidden_size=256)
    scripted_model_dir = train_scripted(wide, tmp_path / "scripted")
    tokenizer = load_tokenizer(scripted_model_dir)
    model = load_policy(ModelConfig(name=str(scripted_model_dir)), str(scripted_model_dir))
    config = rollout_config(vllm_gpu_memory_utilization=0.1, vllm_dtype="float32")
    prompt = [render_prompt(tokenizer, QUESTION, None)]
    hf = MultiTurnEngine(HFEngine(model, tokenizer, config), tokenizer, config)
    expected = hf.generate(prompt, [{}], 2, seeds=[0], greedy=True)
    engine = MultiTurnEngine(VLLMEngine(model, tokenizer, config), tokenizer, config)
    rollout = engine.generate(prompt, [{}], 2, seeds=[0], greedy=True)
    texts = [[t["text"] for t in turns] for turns in rollout.turns]
    assert texts == [[t["text"] for t in turns] for turns in expected.turns]
    assert torch.equal(rollout.completion_ids, expected.completion_ids)
    assert torch.equal(rollout.sampled_mask, expected.sampled_mask)
