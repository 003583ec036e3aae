"""Sampling's linear layers on packed weights (``grpo.rollout.packed_weights``)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from grpo.config import RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout import hf, packed_weights
from grpo.rollout.hf import HFEngine
from grpo.rollout.packed_weights import packed_linears


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_sampling_packs_the_linear_layers_and_samples_the_same(
    tiny_model_dir, monkeypatch, bf16
) -> None:
    # under bf16 autocast on the CPU every nn.Linear multiplies by its weight packed once: the
    # same bf16 products, so the same tokens and log-probs; afterwards the layers are as they
    # were. In float32 a tiny model is never packed (``MIN_FLOAT32_ELEMENTS``)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, load_tokenizer(str(tiny_model_dir)), RolloutConfig(max_new_tokens=8))
    prompts = ["a", "a much longer prompt"]
    calls = []
    packed = packed_weights._packed_linear
    monkeypatch.setattr(packed_weights, "_packed_linear", lambda *a: calls.append(1) or packed(*a))

    def sample(pack: bool):
        with monkeypatch.context() as patch:
            if not pack:
                patch.setattr(
                    hf, "packed_linears", lambda model, float32=False: contextlib.nullcontext()
                )
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return engine.generate(prompts, [{}, {}], group_size=3, seeds=[1, 2])

    got, want = sample(pack=True), sample(pack=False)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert bool(calls) == bf16 and len(calls) % len(linears) == 0
    assert not any("forward" in vars(m) for m in linears)  # each layer's own forward again
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.sampler_logp, want.sampler_logp)


def test_packing_leaves_a_replaced_forward_alone_and_nests(tiny_model_dir) -> None:
    # a forward already set on the instance (accelerate's hooks do this) is neither packed nor
    # removed; a packing inside another packs nothing more and both undo cleanly
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hooked = model.lm_head
    hooked.forward = hooked_forward = lambda x: torch.nn.Linear.forward(hooked, x)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(model):
        assert hooked.forward is hooked_forward
        packed = {m: m.forward for m in linears if m is not hooked}
        assert all(isinstance(f, functools.partial) for f in packed.values())
        with packed_linears(model):
            assert all(m.forward is f for m, f in packed.items())
        assert all(m.forward is f for m, f in packed.items())
    assert hooked.forward is hooked_forward
    assert not any("forward" in vars(m) for m in linears if m is not hooked)


bf16_kernels = pytest.mark.skipif(
    not packed_weights._kernels(torch.bfloat16), reason="no oneDNN bf16 kernels on this CPU"
)


@bf16_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_gives_f_linears_bits_at_real_widths(bias: bool) -> None:
    # SmolLM2's widths and a decode step's to a prefill's rows, with a bias as Qwen2's q/k/v
    gen = torch.Generator().manual_seed(0)
    for k, n in [(576, 576), (576, 192), (576, 1536), (1536, 576)]:
        layer = torch.nn.Linear(k, n, bias=bias).bfloat16()
        with packed_linears(layer):
            assert isinstance(layer.forward, functools.partial)
            for m in (1, 5, 64, 300):
                x = torch.randn(2, m, k, generator=gen).bfloat16()
                assert torch.equal(
                    layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
                )


class _Mixed(torch.nn.Module):
    """A bf16 layer and a float32 one after it, as a LoRA adapter PEFT keeps in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.low, self.high = torch.nn.Linear(8, 8).bfloat16(), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.high(self.low(x).float())


@bf16_kernels
def test_a_float32_layer_of_a_bf16_model_runs_in_float32() -> None:
    model = _Mixed()
    x = torch.randn(4, 8).bfloat16()
    want = model(x)
    with packed_linears(model):
        assert "forward" in vars(model.low) and "forward" not in vars(model.high)
        got = model(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@bf16_kernels
def test_a_failure_while_packing_leaves_no_layer_patched(tiny_model_dir, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reorder, calls = torch.ops.mkldnn._reorder_linear_weight, []

    def failing(weight):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return reorder(weight)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", failing)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of memory"), bf16, packed_linears(model):
        pass
    assert len(calls) == 3
    assert not any("forward" in vars(m) for m in model.modules())


float32_kernels = pytest.mark.skipif(
    not packed_weights._kernels(torch.float32), reason="no oneDNN float32 kernels in this torch"
)


def _count_packed_products(monkeypatch) -> list[int]:
    """Calls of oneDNN's packed product (not of the wrapper, which may fall back to F.linear)."""
    calls: list[int] = []
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or product(*a)
    )
    return calls


@float32_kernels
def test_float32_sampling_on_packed_weights_samples_the_same_tokens(
    tiny_model_dir, monkeypatch
) -> None:
    # asked for, float32 products run on packed weights: oneDNN sums in another order than MKL,
    # so log-probs differ by rounding only (on this tiny model the tokens drawn are the same;
    # on SmolLM2 a few completions take another token)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = RolloutConfig(max_new_tokens=12, pack_float32=True)
    engine = HFEngine(model, load_tokenizer(str(tiny_model_dir)), config)
    calls = _count_packed_products(monkeypatch)
    prompts, rows = ["a", "a much longer prompt", "b c"], [{}, {}, {}]
    got = engine.generate(prompts, rows, group_size=4, seeds=[1, 2, 3])
    assert calls
    with monkeypatch.context() as patch:
        patch.setattr(hf, "packed_linears", lambda model, float32=False: contextlib.nullcontext())
        want = engine.generate(prompts, rows, group_size=4, seeds=[1, 2, 3])
    assert torch.equal(got.completion_ids, want.completion_ids)
    torch.testing.assert_close(got.sampler_logp, want.sampler_logp, rtol=0, atol=1e-5)
    assert not any("forward" in vars(m) for m in model.modules())
    calls.clear()  # unasked, float32 sampling keeps F.linear's products bit for bit
    plain = HFEngine(model, engine.tokenizer, RolloutConfig(max_new_tokens=12))
    assert torch.equal(
        plain.generate(prompts, rows, 4, seeds=[1, 2, 3]).sampler_logp, want.sampler_logp
    )
    assert not calls


@float32_kernels
def test_a_packed_float32_layer_rounds_as_f_linear_does_at_real_widths(monkeypatch) -> None:
    # SmolLM2's widths from a decode step's rows to a prefill's: the same products to float32
    # rounding of their size (oneDNN's order of summation is not MKL's)
    gen = torch.Generator().manual_seed(0)
    calls = _count_packed_products(monkeypatch)
    for k, n in [(576, 576), (576, 192), (576, 1536), (1536, 576)]:
        layer = torch.nn.Linear(k, n)
        with packed_linears(layer, float32=True):
            for m in (1, 5, 64, 300):
                x = torch.randn(m, k, generator=gen)
                want = torch.nn.functional.linear(x, layer.weight, layer.bias)
                torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        with packed_linears(layer):  # not asked: F.linear itself
            layer(x)
    assert len(calls) == 4 * 4


def test_asked_for_float32_packing_that_cannot_happen_is_one_line(
    tiny_model_dir, monkeypatch, capsys
) -> None:
    # no oneDNN ops in this torch (or a model off the CPU): the knob would change nothing, so
    # the engine says so when it is built
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    monkeypatch.setattr(packed_weights, "_kernels", lambda dtype: False)
    capsys.readouterr()  # the model's loading bar
    HFEngine(model, tokenizer, RolloutConfig(pack_float32=True))
    HFEngine(model, tokenizer, RolloutConfig())
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "rollout.pack_float32: nothing is packed (this torch build has no oneDNN packed-weight ops)"
    ]
    model.to("meta")
    assert "samples on meta" in packed_weights.why_float32_unpacked(model)


def test_a_bf16_model_with_float32_adapters_packs_in_bf16() -> None:
    # the session's dtype is that of most weight elements, not of the first layer met: a
    # float32 adapter first does not make a bf16 model's session a float32 one
    adapter, base = torch.nn.Linear(8, 2), torch.nn.Linear(64, 64).bfloat16()
    model = torch.nn.Sequential(adapter, base)
    bf16 = packed_weights._kernels(torch.bfloat16)
    assert packed_weights._packing_dtype([adapter, base], float32=True) == (
        torch.bfloat16 if bf16 else None
    )
    with packed_linears(model, float32=True):
        assert "forward" not in vars(adapter)
        assert ("forward" in vars(base)) == bf16
