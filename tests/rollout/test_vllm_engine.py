"""The vLLM rollout engine: against a stand-in with vllm.LLM's interface (always), and against
vLLM itself when it is installed (slow: `make vllm`, then `make test-slow`)."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo.build import build_engine
from grpo.config import ConfigError, LoraConfig, ModelConfig, RolloutConfig
from grpo.models import build_tiny_model, load_policy, load_tokenizer
from grpo.rollout.vllm import (
    VLLMEngine,
    create_llm,
    merged_weights,
    not_a_rotary_reload_notice,
)
from grpo.scoring.distribution import Decoding
from grpo.scoring.logprobs import completion_logprobs
from grpo.training.trainer import Trainer, train


@dataclass
class FakeSamplingParams:
    """vllm.SamplingParams' fields that the engine sets."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_tokens: int
    stop_token_ids: list[int]
    stop: list[str]
    include_stop_str_in_output: bool
    logprobs: int
    seed: int


@dataclass
class FakeModel:
    """The model inside vLLM's worker: records every reload."""

    loads: list[dict[str, torch.Tensor]] = field(default_factory=list)


class FakeLLM:
    """vllm.LLM's generate / collective_rpc / reset_prefix_cache, sampling seeded token ids.

    Completion k of a request draws tokens from a generator seeded with (seed, k); each token's
    log-prob is -(position + 1) / 10 so the plumbing can be checked. EOS ends a completion.
    Outputs come back in reversed index order, as nothing promises vLLM keeps them sorted.
    """

    def __init__(self, vocab: int, eos: int, script: dict[int, list[list[int]]] | None = None):
        self.vocab, self.eos, self.script = vocab, eos, script or {}
        self.model = FakeModel()
        self.requests: list[tuple[dict, FakeSamplingParams]] = []
        self.cache_resets = 0
        self.shutdowns = 0  # vLLM's in-process engine core, reached as llm.llm_engine.engine_core
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._shutdown))

    def _shutdown(self) -> None:
        self.shutdowns += 1

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
                finish = "stop" if ids[-1] in p.stop_token_ids else "length"
                outs.append(
                    SimpleNamespace(index=k, token_ids=ids, logprobs=logprobs, finish_reason=finish)
                )
            results.append(SimpleNamespace(outputs=outs[::-1]))
        return results

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[None]:
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        self.model.loads.append({n: t.detach().clone() for n, t in kwargs["weights_iterator"]})
        return [None]

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


def test_a_greedy_group_is_one_request_per_member(parts) -> None:
    # vLLM samples greedily only with n=1: a greedy group of 2 is 2 requests at temperature 0
    model, tok = parts
    llm = FakeLLM(len(tok), tok.eos_token_id)
    engine = _engine(model, tok, llm, temperature=0.7)
    out = engine.generate(["a", "b"], [{}, {}], 2, seeds=[5, 9], greedy=True)
    assert [(p.n, p.temperature, p.seed) for _, p in llm.requests] == [
        (1, 0.0, 5),
        (1, 0.0, 5),
        (1, 0.0, 9),
        (1, 0.0, 9),
    ]
    assert out.prompts == ["a", "a", "b", "b"] and out.sampler_logp is None
    first = llm.requests[0][1]
    assert out.completion_ids[0, : len(llm._tokens(first, 0))].tolist() == llm._tokens(first, 0)


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
        probe.state.policy,
        probe.tokenizer,
        config.rollout,
        llm=llm,
        sampling_params=FakeSamplingParams,
    )
    trainer = Trainer(config, engine=engine)
    start = copy.deepcopy(trainer.state.policy.state_dict())
    trainer.train()
    assert len(llm.model.loads) == 2 and llm.cache_resets == 2  # one push per step
    assert llm.shutdowns == 1  # before the process group goes (train's own finally)
    final = trainer.state.policy.state_dict()
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


def test_vllm_info_lines_are_off_the_console_unless_asked_for(parts, monkeypatch) -> None:
    # vLLM reads VLLM_LOGGING_LEVEL when imported (create_llm sets it before `import vllm`)
    seen: list[str | None] = []

    def llm(**_: Any) -> None:
        seen.append(os.environ.get("VLLM_LOGGING_LEVEL"))
        raise RuntimeError("no engine in this test")

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=llm, SamplingParams=None))
    model, tok = parts
    for preset in (None, "INFO"):
        if preset is None:
            monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
        else:
            monkeypatch.setenv("VLLM_LOGGING_LEVEL", preset)
        with pytest.raises(RuntimeError, match="no engine in this test"):
            build_engine("vllm", model=model, tokenizer=tok, config=RolloutConfig())
    assert seen == ["WARNING", "INFO"]  # the default quiet, a user's choice kept


def test_a_resumed_run_pushes_the_restored_weights_before_sampling(tiny_config, tmp_path) -> None:
    # without the push the engine would sample from the base weights until the first update
    reward = tmp_path / "digits.py"  # random completions vary in it: the weights move
    reward.write_text(
        "def digits(completions, **kw):\n"
        "    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions]\n"
    )
    sections = {
        "algorithm": {"beta": 0.0},
        "rewards": {"functions": [{"name": f"{reward}:digits"}]},
    }
    train(tiny_config(**sections, train={"steps": 2}))
    config = tiny_config(**sections, train={"steps": 3})
    probe = Trainer(config)
    llm = FakeLLM(len(probe.tokenizer), probe.tokenizer.eos_token_id)
    engine = VLLMEngine(
        probe.state.policy,
        probe.tokenizer,
        config.rollout,
        llm=llm,
        sampling_params=FakeSamplingParams,
    )
    trainer = Trainer(config, engine=engine)
    pushes_at_rollout = []
    original = engine.generate

    def spy(*args, **kwargs):
        pushes_at_rollout.append(len(llm.model.loads))
        return original(*args, **kwargs)

    engine.generate = spy
    trainer.train()
    assert pushes_at_rollout == [1]  # one step left; the restored weights went in before it
    saved = load_file(config.run_dir / "checkpoints" / "step-2" / "model.safetensors")
    first = llm.model.loads[0]
    assert all(torch.equal(first[k], saved[k]) for k in saved)
    base = AutoModelForCausalLM.from_pretrained(config.model.name).state_dict()
    assert any(not torch.equal(first[k], base[k]) for k in saved)  # trained, not base, weights


# ------------------------------------------------------------------------------ real vLLM
# The same engine against vLLM itself (`make vllm` installs its CPU build). One engine per test
# session, on a tiny random Llama with 64-wide heads (vLLM's CPU attention needs them).

has_vllm = importlib.util.find_spec("vllm") is not None
real = [pytest.mark.slow, pytest.mark.skipif(not has_vllm, reason="vllm is not installed")]

CONTROLS = {
    "temperature": Decoding(temperature=0.7),
    "top_k": Decoding(temperature=0.8, top_k=8),
    "top_p": Decoding(top_p=0.8),
    "min_p": Decoding(min_p=0.1),
    "repetition_penalty": Decoding(repetition_penalty=1.5),
    "all": Decoding(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
}


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "model", hidden_size=256)


@pytest.fixture(scope="session")
def real_llm(wide_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir)
    return create_llm(model, RolloutConfig(engine="vllm", vllm_kv_cache_gb=0.25))


def _config(decoding: Decoding, **rollout: Any) -> RolloutConfig:
    return RolloutConfig(engine="vllm", max_new_tokens=12, **vars(decoding), **rollout)


def _trainer_logp(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model,
            rollout.prompt_ids,
            rollout.prompt_mask,
            rollout.completion_ids,
            rollout.completion_mask,
            rollout.decoding,
        )
    return logp.masked_fill(~rollout.completion_mask, 0.0)


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=real)])
@pytest.mark.parametrize("controls", list(CONTROLS))
def test_sampler_and_trainer_logprobs_mean_one_distribution(
    engine: str, controls: str, wide_model_dir: Path, request: pytest.FixtureRequest
) -> None:
    # both engines report each token's log-prob under the distribution it was drawn from
    # (after penalty, temperature, min-p, top-k, top-p); the trainer's must be the same numbers
    tok = load_tokenizer(str(wide_model_dir))
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir).eval()
    config = _config(CONTROLS[controls])
    if engine == "vllm":
        llm, params = request.getfixturevalue("real_llm")
        sampler = VLLMEngine(model, tok, config, llm=llm, sampling_params=params)
        sampler.sync_weights(model)  # another test may have pushed other weights
    else:
        sampler = build_engine("hf", model=model, tokenizer=tok, config=config)
    prompts = ["abcabc", "hello there", "1+1="]
    out = sampler.generate(prompts, [{}] * 3, 4, seeds=[1, 2, 3])
    assert out.decoding == CONTROLS[controls]
    counted = out.completion_mask
    assert int(counted.sum()) >= 40  # enough tokens for the comparison to mean something
    gap = (_trainer_logp(model, out) - out.sampler_logp).abs()[counted]
    # float32 on both sides; other kernels and summation orders (vLLM) or a KV cache (hf)
    assert float(gap.max()) < 2e-3, float(gap.max())
    plain = Decoding(temperature=CONTROLS[controls].temperature)
    if controls not in ("temperature", "all"):  # the controls really changed the numbers
        with torch.no_grad():
            unprocessed, _ = completion_logprobs(
                model, out.prompt_ids, out.prompt_mask, out.completion_ids, counted, plain
            )
        assert float((unprocessed - out.sampler_logp).abs()[counted].max()) > 0.05


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=real)])
def test_stop_strings_end_completions_on_both_engines(
    engine: str, wide_model_dir: Path, request: pytest.FixtureRequest
) -> None:
    tok = load_tokenizer(str(wide_model_dir))
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir).eval()

    def sample(stop: list[str]):
        config = _config(Decoding(temperature=1.5), stop=stop)
        if engine == "vllm":
            llm, params = request.getfixturevalue("real_llm")
            sampler = VLLMEngine(model, tok, config, llm=llm, sampling_params=params)
            sampler.sync_weights(model)
        else:
            sampler = build_engine("hf", model=model, tokenizer=tok, config=config)
        return sampler.generate(["xyz", "hello"], [{}] * 2, 4, seeds=[4, 5])

    free = sample([])
    # stop at a character each completion has (one token each: a character tokenizer); the same
    # seeds then draw the same tokens, cut after the first stop character
    stop = sorted({text[2] for text in free.completions if len(text) > 3})[:3]
    cut = sample(stop)
    stopped = 0
    for i, text in enumerate(free.completions):
        if any(s in text for s in stop):
            n = int(cut.completion_mask[i].sum())
            assert torch.equal(cut.completion_ids[i, :n], free.completion_ids[i, :n])
            ids = cut.completion_ids[i, :n].tolist()
            assert any(s in tok.decode(ids) for s in stop)  # the last token completed a stop
            assert not any(s in tok.decode(ids[:-1]) for s in stop)
            assert not cut.truncated[i]
            stopped += 1
        else:
            assert cut.completions[i] == text and cut.truncated[i] == free.truncated[i]
    assert stopped >= 4


@pytest.mark.parametrize("lora", [False, pytest.param(True, id="lora")])
@pytest.mark.slow
@pytest.mark.skipif(not has_vllm, reason="vllm is not installed")
def test_real_vllm_samples_from_the_pushed_weights(
    lora: bool, wide_model_dir: Path, real_llm
) -> None:
    # the trained policy's log-probs, not the base model's, are what vLLM reports after a push
    tok = load_tokenizer(str(wide_model_dir))
    config = ModelConfig(name=str(wide_model_dir), lora=LoraConfig(enabled=lora, r=8))
    policy = load_policy(config, str(wide_model_dir)).eval()
    base = AutoModelForCausalLM.from_pretrained(wide_model_dir).eval()
    with torch.no_grad():  # a large, known change: what a few optimizer steps would do
        for name, p in policy.named_parameters():
            if p.requires_grad and ("lora_B" in name or not lora):
                p.add_(torch.randn_like(p) * (0.2 if lora else 0.05))
    llm, params = real_llm
    engine = VLLMEngine(policy, tok, _config(Decoding()), llm=llm, sampling_params=params)
    engine.sync_weights(policy)
    out = engine.generate(["abc", "hello"], [{}] * 2, 4, seeds=[7, 8])
    counted = out.completion_mask
    to_policy = (_trainer_logp(policy, out) - out.sampler_logp).abs()[counted]
    to_base = (_trainer_logp(base, out) - out.sampler_logp).abs()[counted]
    assert float(to_policy.max()) < 2e-3
    assert float(to_base.mean()) > 0.1  # the push really changed the distribution


def test_generation_kwargs_pass_through_and_clashes(parts) -> None:
    model, tok = parts
    llm = FakeLLM(len(tok), tok.eos_token_id)
    with pytest.raises(ConfigError, match=r"generation_kwargs\.seed: set train\.seed"):
        _engine(model, tok, llm, generation_kwargs={"seed": 3})
    # the stand-in's SamplingParams has no such field: vLLM's TypeError becomes one line
    with pytest.raises(ConfigError, match=r"rollout\.generation_kwargs: .*presence_penalty"):
        _engine(model, tok, llm, generation_kwargs={"presence_penalty": 0.5})


def test_the_rotary_reload_false_alarm_is_dropped_and_nothing_else() -> None:
    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, message, None, None)

    assert not not_a_rotary_reload_notice(record("RotaryEmbedding: Failed to load weights"))
    assert not_a_rotary_reload_notice(record("LlamaMLP: Failed to load weights"))


@pytest.mark.slow
@pytest.mark.skipif(not has_vllm, reason="vllm is not installed")
def test_a_real_vllm_run_exits_without_a_traceback(wide_model_dir: Path, tmp_path: Path) -> None:
    # vLLM's exit hook shut its engine down after the trainer had closed the process group it
    # joined, and printed a traceback after "run finished" (exit code 0 all the same)
    recipe = tmp_path / "recipe.yaml"
    tree = {
        "model": {"name": str(wide_model_dir)},
        "data": {"task": "arithmetic", "task_args": {"size": 16}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "train": {"steps": 1, "output_dir": str(tmp_path / "runs"), "progress": False},
    }
    recipe.write_text(yaml.safe_dump(tree))
    grpo = [sys.executable, "-m", "grpo.cli", "train", str(recipe)]
    done = subprocess.run(
        [*grpo, "rollout.engine=vllm", "rollout.vllm_kv_cache_gb=0.25"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run finished" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not has_vllm, reason="vllm is not installed")
def test_real_vllm_continues_a_turn_after_an_observation(wide_model_dir: Path, real_llm) -> None:
    # an environment's second turn: the context is the prompt, the first turn's tokens and an
    # observation the model never sampled; vLLM resumes exactly there, and its log-probs are the
    # trainer's for the same tokens after the same context
    from grpo.rollout.turns import TurnRequest

    tok = load_tokenizer(str(wide_model_dir))
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir).eval()
    llm, params = real_llm
    engine = VLLMEngine(
        model, tok, _config(Decoding(temperature=0.9)), llm=llm, sampling_params=params
    )
    engine.sync_weights(model)
    prompt = tok("guess:", add_special_tokens=False).input_ids
    (first,) = engine.generate_turns([TurnRequest(prompt, 1, 11, 6)], stop=[])[0]
    observation = tok(" lower.", add_special_tokens=False).input_ids
    context = prompt + first.token_ids + observation
    second = engine.generate_turns([TurnRequest(context, 2, 12, 6)], stop=[])[0]
    for sample in second:
        ids = torch.tensor([context + sample.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(context) - 1 : -1].float() / 0.9
        trainer = logits.log_softmax(-1).gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        gap = (trainer - torch.tensor(sample.logprobs)).abs().max()
        assert float(gap) < 2e-3, float(gap)
    assert second[0].token_ids != second[1].token_ids  # two samples of the group, not one twice


@pytest.mark.slow
@pytest.mark.skipif(not has_vllm, reason="vllm is not installed")
def test_a_real_vllm_run_plays_an_environment_class(wide_model_dir: Path, tmp_path: Path) -> None:
    # rollout.environment on the vLLM engine: the same turn loop, one instance per completion,
    # the environment's reward paid, and a clean exit
    envs = Path(__file__).parents[1] / "environments" / "trl_envs.py"
    recipe = tmp_path / "recipe.yaml"
    tree = {
        "model": {"name": str(wide_model_dir), "precision": "float32"},
        "data": {"task": "arithmetic", "task_args": {"size": 16}},
        "rollout": {
            "engine": "vllm",
            "vllm_kv_cache_gb": 0.25,
            "environment": f"{envs}:GuessNumber",
            "prompts_per_step": 2,
            "group_size": 2,
            "max_new_tokens": 8,
        },
        "rewards": {"functions": [{"name": "environment"}, {"name": "format"}]},
        "train": {"steps": 2, "output_dir": str(tmp_path / "runs"), "progress": False},
    }
    recipe.write_text(yaml.safe_dump(tree))
    done = subprocess.run(
        [sys.executable, "-m", "grpo.cli", "train", str(recipe)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    runs = list((tmp_path / "runs").iterdir())
    metrics = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "event" not in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["env/turns"] >= 1.0 and m["env/errors"] == 0.0
        assert m["reward/environment/mean"] == 0.0  # no guess from a random model
    completions = (runs[0] / "completions" / "step-000001.jsonl").read_text()
    assert "Guess my number (1-8)." in completions  # reset's text joined the prompt
