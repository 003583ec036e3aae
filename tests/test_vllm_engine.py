"""The vLLM rollout engine against a CPU stand-in with vllm.LLM's interface (no vLLM needed)."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.config import ConfigError, LoraConfig, ModelConfig, RolloutConfig
from grpo.models import load_policy, load_tokenizer
from grpo.rollout import build_engine
from grpo.rollout.vllm import VLLMEngine, merged_weights
from grpo.trainer import Trainer


@dataclass
class FakeSamplingParams:
    """vllm.SamplingParams' fields that the engine sets."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: list[int]
    logprobs: int
    seed: int


@dataclass
class FakeModel:
    """The model inside vLLM's worker: records every load_weights call."""

    loads: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loads.append({name: t.detach().clone() for name, t in weights})


class FakeLLM:
    """vllm.LLM's generate / apply_model / reset_prefix_cache, sampling seeded token ids.

    Completion k of a request draws tokens from a generator seeded with (seed, k); each token's
    log-prob is -(position + 1) / 10 so the plumbing can be checked. EOS ends a completion.
    Outputs come back in reversed index order, as nothing promises vLLM keeps them sorted.
    """

    def __init__(self, vocab: int, eos: int, script: dict[int, list[list[int]]] | None = None):
        self.vocab, self.eos, self.script = vocab, eos, script or {}
        self.model = FakeModel()
        self.requests: list[tuple[dict, FakeSamplingParams]] = []
        self.cache_resets = 0

    def _tokens(self, params: FakeSamplingParams, k: int) -> list[int]:
        if params.seed in self.script:
            return self.script[params.seed][k]
        g = torch.Generator().manual_seed(params.seed * 1000 + k)
        out: list[int] = []
        while len(out) < params.max_tokens:
            tok = int(torch.randint(6, self.vocab, (1,), generator=g))
            tok = self.eos if torch.rand(1, generator=g) < 0.15 else tok
            out.append(tok)
            if tok in params.stop_token_ids:
                break
        return out

    def generate(self, requests: list[dict], params: list[FakeSamplingParams], use_tqdm: bool):
        results = []
        for request, p in zip(requests, params, strict=True):
            self.requests.append((request, p))
            outs = []
            for k in range(p.n):
                ids = self._tokens(p, k)
                logprobs = [
                    {tok: SimpleNamespace(logprob=-(j + 1) / 10)} for j, tok in enumerate(ids)
                ]
                outs.append(SimpleNamespace(index=k, token_ids=ids, logprobs=logprobs))
            results.append(SimpleNamespace(outputs=outs[::-1]))
        return results

    def apply_model(self, func: Any) -> list[Any]:
        return [func(self.model)]

    def reset_prefix_cache(self) -> None:
        self.cache_resets += 1


@pytest.fixture
def parts(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return model, tok


def _engine(model, tok, llm, **rollout) -> VLLMEngine:
    config = RolloutConfig(**{"max_new_tokens": 6, **rollout})
    return VLLMEngine(model, tok, config, llm=llm, sampling_params=FakeSamplingParams)


def test_one_request_per_prompt_asks_for_the_group(parts) -> None:
    model, tok = parts
    llm = FakeLLM(len(tok), tok.eos_token_id)
    engine = _engine(model, tok, llm, temperature=0.7, top_k=0)
    prompts = ["1+1?", "a longer prompt"]
    out = engine.generate(prompts, [{"prompt": p} for p in prompts], 3, seeds=[5, 9])
    assert len(llm.requests) == 2
    (r0, p0), (r1, p1) = llm.requests
    assert r1["prompt_token_ids"] == tok("a longer prompt", add_special_tokens=False).input_ids
    assert r0["prompt_token_ids"] == tok("1+1?", add_special_tokens=False).input_ids
    assert (p0.n, p0.seed, p1.seed) == (3, 5, 9)
    assert p0.logprobs == 0 and p0.temperature == 0.7 and p0.top_k == -1  # -1: no top-k
    assert p0.stop_token_ids == [tok.eos_token_id] and p0.max_tokens == 6
    # prompts repeated per completion, groups contiguous, left padded
    assert out.prompts == ["1+1?"] * 3 + ["a longer prompt"] * 3
    assert out.prompt_ids.shape[0] == 6 and out.rows == [{"prompt": p} for p in prompts]
    n_short = len(r0["prompt_token_ids"])
    assert out.prompt_mask[0].sum() == n_short and not out.prompt_mask[0, 0]
    assert out.prompt_ids[0, -n_short:].tolist() == r0["prompt_token_ids"]
    # completion k of prompt i sits at row i*G + k although vLLM returned them reversed
    for k in range(3):
        assert out.completion_ids[k, : len(llm._tokens(p0, k))].tolist() == llm._tokens(p0, k)


def test_masks_truncation_and_sampler_logprobs(parts) -> None:
    model, tok = parts
    eos = tok.eos_token_id
    tok.pad_token = tok.eos_token  # pad == EOS (as in SmolLM2) must not fake a stop
    script = {1: [[10, 11, eos], [12, 13, 14, 15, 16, 17]], 2: [[eos], [20, eos]]}
    llm = FakeLLM(len(tok), eos, script)
    out = _engine(model, tok, llm).generate(["a", "b"], [{}, {}], 2, seeds=[1, 2])
    assert out.completion_mask.tolist() == [
        [True, True, True, False, False, False],  # EOS counts, nothing after it
        [True] * 6,  # cut at max_new_tokens
        [True, False, False, False, False, False],  # immediate EOS
        [True, True, False, False, False, False],
    ]
    assert out.truncated.tolist() == [False, True, False, False]
    # log-prob of token j is -(j+1)/10 in the stand-in; zero where the mask is off
    expected = torch.tensor([-(j + 1) / 10 for j in range(6)]).expand(4, 6)
    expected = expected * out.completion_mask
    assert torch.allclose(out.sampler_logp, expected, atol=1e-7)
    assert out.completions[0] == tok.decode([10, 11, eos], skip_special_tokens=True)


def test_weights_are_pushed_after_every_optimizer_step(tiny_config, tmp_path) -> None:
    reward = tmp_path / "digits.py"  # a reward random completions vary in: non-zero advantages
    reward.write_text(
        "def digits(completions, **kw):\n"
        "    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions]\n"
    )
    config = tiny_config(
        algorithm={"beta": 0.0},
        train={"steps": 2},
        rewards={"functions": [{"name": f"{reward}:digits"}]},
    )
    probe = Trainer(config)
    llm = FakeLLM(len(probe.tokenizer), probe.tokenizer.eos_token_id)
    engine = VLLMEngine(
        probe.policy, probe.tokenizer, config.rollout, llm=llm, sampling_params=FakeSamplingParams
    )
    trainer = Trainer(config, engine=engine)
    start = copy.deepcopy(trainer.policy.state_dict())
    trainer.train()
    assert len(llm.model.loads) == 2 and llm.cache_resets == 2  # one push per step
    final = trainer.policy.state_dict()
    pushed = llm.model.loads[-1]
    assert pushed.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(pushed[name], value), name
    first = llm.model.loads[0]
    assert any(not torch.equal(first[k], start[k]) for k in start)  # step 1's weights, not start


def test_lora_pushes_merged_weights_and_keeps_the_adapters(tiny_model_dir) -> None:
    config = ModelConfig(name=str(tiny_model_dir), lora=LoraConfig(enabled=True, r=4))
    policy = load_policy(config, str(tiny_model_dir))
    with torch.no_grad():  # non-zero B so that merging changes the weights
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()
    merged = merged_weights(policy)
    assert merged.keys() == expected.keys()
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    for key, value in expected.items():
        assert torch.allclose(merged[key], value, atol=1e-6), key
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], before[f"base_model.model.{q[:-7]}.base_layer.weight"])
    after = policy.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # adapters and base untouched


def test_missing_vllm_is_one_clear_line(parts, monkeypatch) -> None:
    model, tok = parts
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'grpo\[vllm\]'"):
        build_engine("vllm", model=model, tokenizer=tok, config=RolloutConfig())
