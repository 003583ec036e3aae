"""The compiled decode step (``rollout.compile``): what it traces gives the model's own logits,
a compilation that fails or disagrees is said once and the model decodes eagerly."""

from __future__ import annotations

import os

import pytest
import torch
from test_decode import decode_both, llama, mistral, qwen2, qwen3
from torch._inductor.runtime.cache_dir_utils import cache_dir
from transformers import AutoModelForCausalLM

from grpo.config import ModelConfig, RolloutConfig
from grpo.models import load_policy, load_tokenizer
from grpo.rollout import compiled, decode, kv_cache
from grpo.rollout.hf import HFEngine


@pytest.fixture
def traced_eagerly(monkeypatch):
    """torch.compile as the identity: the traced step runs as Python, in a second."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


@pytest.mark.parametrize("build", [llama, mistral, qwen2, qwen3])
def test_the_traced_step_gives_the_models_own_logits(build, traced_eagerly, monkeypatch) -> None:
    model = build()
    assert compiled.compilable(model)
    # decode_both's second path: the compiled step over weights cast (here: kept) once
    monkeypatch.setattr(decode, "lean_step", lambda m: compiled.compiled_step(m, torch.float32))
    with torch.no_grad():
        pairs = decode_both(model)
    # the same products; attention sums over the buffer in another order than SDPA
    assert all(torch.allclose(own, got, atol=1e-5, rtol=0) for own, got in pairs)
    assert not torch.equal(pairs[0][0], pairs[1][0])  # the steps did move on


def test_the_traced_step_on_bf16_buffers_gives_what_it_gives_on_float32_ones(
    traced_eagerly, monkeypatch
) -> None:
    # under bf16 autocast the reserved cache holds bf16 keys (kv_cache.attended_dtype); the
    # compiled step writes and reads its buffers directly, and multiplies in bf16 either way
    monkeypatch.setattr(decode, "lean_step", lambda m: compiled.compiled_step(m, torch.bfloat16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        # two equal models (llama() seeds), each compiled and checked at its first step, on
        # the same prompts
        narrow = [got for _, got in decode_both(llama())]
        monkeypatch.setattr(kv_cache, "attended_dtype", lambda m: None)
        wide = [got for _, got in decode_both(llama())]
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide, strict=True))
    assert not torch.equal(narrow[0], narrow[1])


def _rollout(model, tokenizer, compile: bool, ending: bool = False):
    """``ending``: half the vocabulary ends a completion, so rows finish at different tokens."""
    engine = HFEngine(
        model, tokenizer, RolloutConfig(max_new_tokens=10, group_size=3, compile=compile)
    )
    if ending:
        engine.eos = list(range(0, model.config.vocab_size, 2))
    return engine.generate(["1 + 1 =", "a much longer prompt, 2 + 2 ="], [{}, {}], 3, seeds=[5, 6])


@pytest.fixture
def tiny(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, load_tokenizer(tiny_model_dir)


def test_a_rollout_decodes_compiled_when_asked(tiny, traced_eagerly, capsys) -> None:
    model, tokenizer = tiny
    eager = _rollout(model, tokenizer, compile=False)
    assert "rollout.compile" not in capsys.readouterr().err
    got = _rollout(model, tokenizer, compile=True)
    assert "rollout.compile: LlamaForCausalLM's decode step compiled in" in capsys.readouterr().err
    assert torch.equal(got.completion_ids, eager.completion_ids)
    assert torch.allclose(got.sampler_logp, eager.sampler_logp, atol=1e-5, rtol=0)
    _rollout(model, tokenizer, compile=True)  # checked once per model: said once
    assert "rollout.compile" not in capsys.readouterr().err


def test_a_compilation_that_fails_is_said_once_and_decodes_eagerly(
    tiny, monkeypatch, capsys
) -> None:
    def no_compiler(fn, **kwargs):
        def fails(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    model, tokenizer = tiny
    eager = _rollout(model, tokenizer, compile=False)
    decode._VERIFIED.pop(model)  # so the steps after the failure show which step they take
    got = _rollout(model, tokenizer, compile=True)
    # the rest of that rollout decoded as without rollout.compile: the lean step, checked once
    assert decode._VERIFIED.get(model) is True
    _rollout(model, tokenizer, compile=True)
    err = capsys.readouterr().err
    line = (
        "rollout.compile: LlamaForCausalLM decodes eagerly "
        "(RuntimeError: InvalidCxxCompiler: No working C++ compiler found)\n"
    )
    assert err == line
    assert torch.equal(got.completion_ids, eager.completion_ids)
    assert torch.equal(got.sampler_logp, eager.sampler_logp)
    assert not compiled.wanted(True, model)  # later sessions pack their weights again


def test_a_step_that_is_off_from_the_models_forward_is_refused(tiny, monkeypatch, capsys) -> None:
    def off(fn, **kwargs):
        return lambda *args: fn(*args) + torch.linspace(0, 3, fn(*args).shape[-1])

    monkeypatch.setattr(torch, "compile", off)
    model, tokenizer = tiny
    eager = _rollout(model, tokenizer, compile=False)
    got = _rollout(model, tokenizer, compile=True)
    err = capsys.readouterr().err
    assert (
        "rollout.compile: LlamaForCausalLM decodes eagerly (max |log-prob diff| 1.9 against its own forward)"
        in err
    )
    assert torch.equal(got.completion_ids, eager.completion_ids)


def test_models_it_does_not_mirror_are_not_compiled(tiny_model_dir) -> None:
    lora = load_policy(ModelConfig(lora={"enabled": True, "r": 4}), str(tiny_model_dir))
    hooked = llama()
    hooked.model.layers[0].self_attn.register_forward_hook(lambda *a: None)
    for model in (
        lora,
        hooked,
        qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0),
    ):
        assert not compiled.compilable(model)


def test_asking_to_compile_a_model_it_does_not_mirror_is_said(tiny_model_dir, capsys) -> None:
    lora = load_policy(ModelConfig(lora={"enabled": True, "r": 4}), str(tiny_model_dir))
    tokenizer = load_tokenizer(tiny_model_dir)
    eager = _rollout(lora, tokenizer, compile=False)
    assert "rollout.compile" not in capsys.readouterr().err
    got = _rollout(lora, tokenizer, compile=True)
    assert capsys.readouterr().err.startswith(
        "rollout.compile: PeftModelForCausalLM decodes eagerly (the compiled step mirrors"
    )
    assert torch.equal(got.completion_ids, eager.completion_ids)


@pytest.mark.slow
def test_inductor_compiles_a_step_that_samples_as_the_eager_one(tiny, capsys) -> None:
    model, tokenizer = tiny
    eager = _rollout(model, tokenizer, compile=False)
    got = _rollout(model, tokenizer, compile=True)
    assert "decode step compiled in" in capsys.readouterr().err
    assert torch.equal(got.completion_ids, eager.completion_ids)
    assert torch.allclose(got.sampler_logp, eager.sampler_logp, atol=1e-4, rtol=0)


def test_a_recompilation_that_fails_mid_rollout_goes_on_eagerly(tiny, monkeypatch, capsys) -> None:
    def fails_later(fn, **kwargs):
        calls = iter(range(10**6))

        def step(*args):
            if next(calls) >= 3:  # rows left the batch: a shape it was not compiled for
                raise RuntimeError("CppCompileError: C++ compile error")
            return fn(*args)

        return step

    monkeypatch.setattr(torch, "compile", fails_later)
    model, tokenizer = tiny
    eager = _rollout(model, tokenizer, compile=False)
    got = _rollout(model, tokenizer, compile=True)
    err = capsys.readouterr().err.splitlines()
    assert (
        err[-1]
        == "rollout.compile: LlamaForCausalLM decodes eagerly (RuntimeError: CppCompileError: C++ compile error)"
    )
    assert torch.equal(got.completion_ids, eager.completion_ids)
    assert torch.allclose(got.sampler_logp, eager.sampler_logp, atol=1e-5, rtol=0)


def test_kernels_are_cached_in_grpos_folder_unless_inductors_is_named(tiny, monkeypatch) -> None:
    model, _ = tiny
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compiled._Compiled(model, graphs=False)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compiled.KERNEL_CACHE)
    assert compiled.KERNEL_CACHE.parts[-3:] == (".cache", "grpo", "inductor")
    # importing peft (as loading a policy does) has inductor write its own default folder
    # into the variable before any step compiles: that is no choice of the user's
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    inductors_default = cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == inductors_default
    compiled._Compiled(model, graphs=False)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compiled.KERNEL_CACHE)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # the user's choice stands
    compiled._Compiled(model, graphs=False)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


@pytest.fixture
def graphed(monkeypatch, device):
    """The CUDA-graph path on the test's device: its static shapes on the CPU too, where inductor
    skips the capture."""
    monkeypatch.setattr(compiled, "GRAPHED_DEVICES", {device.type})


@pytest.fixture
def tiny_on_device(tiny_model_dir, device):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device).eval()
    return model, load_tokenizer(tiny_model_dir)


def _recording_compile(calls: list, options: list):
    def compile(fn, **kwargs):
        options.append(kwargs)

        def step(tokens, positions, allowed, at, w, keys, values):
            calls.append((tokens.shape[0], allowed.shape[-1], [k.data_ptr() for k in keys]))
            return fn(tokens, positions, allowed, at, w, keys, values)

        return step

    return compile


@pytest.mark.device
def test_a_graphed_rollout_decodes_static_shapes_and_samples_as_the_eager_one(
    tiny_on_device, graphed, monkeypatch
) -> None:
    model, tokenizer = tiny_on_device
    eager = _rollout(model, tokenizer, compile=False, ending=True)
    calls, options, replays = [], [], []
    monkeypatch.setattr(torch, "compile", _recording_compile(calls, options))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: replays.append(1))
    got = _rollout(model, tokenizer, compile=True, ending=True)
    assert options == [{"fullgraph": True, "mode": "reduce-overhead", "dynamic": None}]
    assert len(replays) == len(calls)  # each step begins a new replay
    # every row stays in the batch and attention reads the whole bucketed buffer, whose
    # unwritten positions are masked: the same tokens
    assert {(rows, span) for rows, span, _ in calls} == {(6, compiled.GRAPHED_POSITIONS)}
    assert len(calls) > 2 and int(got.completion_mask.sum(1).min()) < len(calls)  # rows ended
    assert torch.equal(got.completion_ids, eager.completion_ids)
    assert torch.allclose(got.sampler_logp, eager.sampler_logp, atol=1e-5, rtol=0)
    first = calls[0][2]
    calls.clear()
    _rollout(model, tokenizer, compile=True, ending=True)  # the next rollout: the same buffers
    assert all(ptrs == first for _, _, ptrs in calls)
    # the pool keeps the group's decode buffers only, not the prompts' prefill ones
    held = compiled.buffer_pool(model).held
    assert {rows for _, _, rows, *_ in held} == {6} and len(held) == 2 * len(first)


def test_the_buffer_pool_keeps_the_longest_cache_and_lends_its_front() -> None:
    made = []
    pool = kv_cache.BufferPool(made.append)
    like = torch.ones(2, 3, 5, 4)
    small = pool.take(0, "keys", like, 64)
    assert small.shape == (2, 3, 64, 4) and not small.any() and made == [small]
    small[0, 0, 0, 0] = 7.0  # an earlier rollout's number
    assert pool.take(0, "keys", like, 32) is small  # a shorter rollout: the same buffer
    assert pool.take(0, "values", like, 32) is not small
    assert pool.take(1, "keys", like, 32) is not small
    larger = pool.take(0, "keys", like, 128)
    assert larger.shape[2] == 128 and pool.take(0, "keys", like, 64) is larger
    assert pool.take(0, "keys", like.bfloat16(), 64).dtype == torch.bfloat16
    assert len(made) == 5


def test_graphed_capacities_are_powers_of_two() -> None:
    got = [compiled.graphed_capacity(n) for n in (1, 64, 65, 93, 128, 129, 1100)]
    assert got == [64, 64, 128, 128, 128, 256, 2048]


def test_a_second_rollout_that_takes_the_graphs_cache_mid_rollout_stops_the_first(
    tiny, graphed, monkeypatch
) -> None:
    # a captured graph reads and writes the pool's buffers wherever it recorded them: a rollout
    # of the same model started in the middle of another (another thread) rewrites the first
    # one's keys, which must stop it rather than let it sample from them
    model, tokenizer = tiny
    calls = []

    def compile(fn, **kwargs):
        def step(*args):
            calls.append(1)
            if len(calls) == 2:  # the first rollout's second step: another rollout runs now
                _rollout(model, tokenizer, compile=True)
            return fn(*args)

        return step

    monkeypatch.setattr(torch, "compile", compile)
    with pytest.raises(RuntimeError, match="another rollout of LlamaForCausalLM took its CUDA"):
        _rollout(model, tokenizer, compile=True)
    assert len(calls) > 3  # the second rollout decoded on, and the first stopped after it
    _rollout(model, tokenizer, compile=True)  # one at a time, as before


def test_without_graphs_finished_rows_leave_the_batch(tiny, monkeypatch) -> None:
    model, tokenizer = tiny
    calls, options = [], []
    monkeypatch.setattr(torch, "compile", _recording_compile(calls, options))
    got = _rollout(model, tokenizer, compile=True, ending=True)
    assert options == [{"fullgraph": True, "dynamic": True}]
    assert int(got.completion_mask.sum(1).min()) < len(calls)
    assert min(rows for rows, _, _ in calls) < 6
    assert all(span < compiled.GRAPHED_POSITIONS for _, span, _ in calls)


def test_a_graphed_step_reads_each_rollouts_weights_at_the_same_addresses(
    tiny, graphed, traced_eagerly
) -> None:
    model, _ = tiny
    entry = compiled._entry(model)
    assert entry.graphs
    own = compiled._held_weights(entry, model, torch.float32)
    assert own.head.weight.data_ptr() == model.lm_head.weight.data_ptr()  # no copy
    held = compiled._held_weights(entry, model, torch.bfloat16)
    assert held.head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    again = compiled._held_weights(entry, model, torch.bfloat16)
    assert all(
        a is b for a, b in zip(compiled._tensors(held), compiled._tensors(again), strict=True)
    )
    q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(again.layers[0].q.weight, q.to(torch.bfloat16))
    assert compiled._tensors(again)[0]._dynamo_static_input_type is not None


@pytest.fixture
def static_inputs():
    """The sources of the traced step's inputs that inductor takes as static (a CUDA graph
    reads them where it recorded them) and as not: what torch logs as it decides."""
    import logging

    seen = {True: set(), False: set()}

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            source = message.split(" for source ")[-1]
            # a size dynamo made dynamic (dynamo's memory of earlier shapes) is an int input
            if " input pos " in message and ".size()" not in source:
                seen[message.startswith("Adding static")].add(source)

    log = logging.getLogger(
        "torch._functorch._aot_autograd.frontend_utils.__cudagraph_static_inputs"
    )
    handler = Record()
    log.addHandler(handler)
    torch._logging.set_logs(cudagraph_static_inputs=True)
    yield seen
    torch._logging.set_logs()
    log.removeHandler(handler)


@pytest.mark.slow
@pytest.mark.device  # gpu-check runs it on CUDA, where inductor captures the step
def test_inductor_compiles_a_graphed_step_once_for_rollouts_of_one_bucket(
    tiny_on_device, graphed, static_inputs, device, capsys
) -> None:
    from torch._dynamo.utils import counters

    model, tokenizer = tiny_on_device
    eager = _rollout(model, tokenizer, compile=False, ending=True)
    before = counters["stats"]["unique_graphs"]
    skipped = counters["inductor"]["cudagraph_skips"]
    got = _rollout(model, tokenizer, compile=True, ending=True)
    # a graph may write the KV cache and read the weights in place, and takes each step's own
    # tokens, positions and mask as inputs copied in
    assert static_inputs[False] == {"L['tokens']", "L['positions']", "L['allowed']", "L['at']"}
    layers = model.config.num_hidden_layers
    cache = {f"L['{role}'][{i}]" for role in ("keys", "values") for i in range(layers)}
    assert cache <= static_inputs[True]
    assert {s for s in static_inputs[True] if s.startswith("L['w']")} == {
        *(f"L['w'].layers[{i}].{n}.weight" for i in range(layers) for n in compiled.PROJECTIONS),
        "L['w'].head.weight",
    }
    # captured on a GPU; on a CPU inductor skips the capture (the counter gpu-check reads),
    # and the run says so
    assert (counters["inductor"]["cudagraph_skips"] > skipped) == (device.type == "cpu")
    said = [line for line in capsys.readouterr().err.splitlines() if "rollout.compile" in line]
    assert len(said) == 1 and "decode step compiled in" in said[0]
    assert ("without CUDA graphs" in said[0]) == (device.type == "cpu")
    assert torch.equal(got.completion_ids, eager.completion_ids)
    assert torch.allclose(got.sampler_logp, eager.sampler_logp, atol=1e-4, rtol=0)
    recorded = counters["inductor"]["cudagraph_recorded_non_static_inputs"]
    engine = HFEngine(
        model, tokenizer, RolloutConfig(max_new_tokens=10, group_size=3, compile=True)
    )
    engine.generate(["another prompt", "and one more, of other length"], [{}, {}], 3, seeds=[1, 2])
    # every step of both rollouts (other prompts, the same bucket) replays one graph, recorded
    # once: the second rollout finds its inputs where the first left them
    assert counters["stats"]["unique_graphs"] - before == 1
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] == recorded
