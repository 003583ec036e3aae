"""Prefix attention: packed groups without the dense mask, the same numbers as the mask, and
SDPA unchanged for every other forward (its equality with full sequences, values and gradients,
is in tests/bench/test_bench_logprobs.py)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grpo.config import ModelConfig, RolloutConfig
from grpo.models import disable_dropout, load_policy, load_tokenizer
from grpo.rollout.hf import HFEngine
from grpo.scoring import prefix_attention
from grpo.scoring.logprobs import completion_logprobs
from grpo.scoring.packing import attention_dropout_on, pack, packed_logprobs
from grpo.scoring.prefix_attention import (
    PREFIX,
    prefix_attention_forward,
    prefix_layout,
    use_prefix_attention,
)


def _batch():
    # prompts of 4 and 2 tokens (left padded to 4); completions of 3, 1, 4 and 2 tokens
    prompt_ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [0, 0, 9, 10], [0, 0, 9, 10]])
    prompt_mask = prompt_ids != 0
    completion_ids = torch.tensor(
        [[11, 12, 13, 0], [14, 0, 0, 0], [15, 16, 17, 18], [19, 20, 0, 0]]
    )
    return prompt_ids, prompt_mask, completion_ids, completion_ids != 0


def _shared_batch():
    # three prompts that start alike ([5, 6], a system prompt's part), of 4, 3 and 4 tokens;
    # completions of 3, 1 (prompt [5, 6, 7, 8]), 4, 2 ([5, 6, 9]) and 2 ([5, 6, 7, 10]) tokens
    prompt_ids = torch.tensor(
        [[5, 6, 7, 8], [5, 6, 7, 8], [0, 5, 6, 9], [0, 5, 6, 9], [5, 6, 7, 10]]
    )
    completion_ids = torch.tensor(
        [[11, 12, 13, 0], [14, 0, 0, 0], [15, 16, 17, 18], [19, 20, 0, 0], [21, 22, 0, 0]]
    )
    return prompt_ids, prompt_ids != 0, completion_ids, completion_ids != 0


BATCHES = pytest.mark.parametrize("batch", [_batch, _shared_batch], ids=["apart", "shared"])


def _pair(tiny_model_dir, **config):
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, **config).train()
    prefix = copy.deepcopy(sdpa)
    assert use_prefix_attention(prefix)
    assert prefix.config._attn_implementation == PREFIX
    return sdpa, prefix


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@BATCHES
@pytest.mark.parametrize("end_to_end", [False, True])
def test_the_layout_reads_what_the_dense_mask_allows(batch, end_to_end: bool) -> None:
    packed = pack(*batch(), end_to_end=end_to_end)
    layout = prefix_layout(packed.segment, packed.group)
    dense = packed.attention_mask(torch.bool)[:, 0]  # [U, L, L]
    u_count, length = packed.segment.shape
    seen = torch.zeros(u_count * length, u_count * length, dtype=torch.bool)
    # each position reads one row of the outputs laid end to end: prompts' [U, P] slots, then
    # the completions' [R, N], then a row of zeros
    prompt_slots, row_slots = layout.prompt_at.numel(), layout.rows_query.numel()
    zero_row = prompt_slots + row_slots
    for position, slot in enumerate(layout.source.tolist()):
        if slot == zero_row:
            continue
        if slot < prompt_slots:
            at, blocked, keys = layout.prompt_at, layout.prompt_blocked, layout.prompt_at
        else:
            at, blocked, keys = layout.rows_query, layout.rows_blocked, layout.rows_key
            slot -= prompt_slots
        r, i = divmod(slot, at.shape[1])
        assert at[r, i] == position  # the slot holds this position's query
        seen[position, keys[r][~blocked[r, 0, i]]] = True
    want = torch.block_diag(*dense)  # sequence u's positions are u * L ... u * L + L - 1
    real_query = packed.segment.flatten() >= 0
    assert torch.equal(seen[real_query], want[real_query])
    # every real position reads a slot of its own (its gradient counted once), padding zeros
    read = layout.source[real_query]
    assert (read < zero_row).all() and len(read.unique()) == len(read)
    assert (layout.source[~real_query] == zero_row).all()


@pytest.mark.device
@BATCHES
def test_prefix_scoring_equals_the_masked_one_under_checkpointing(tiny_model_dir, device, batch):
    # the layout travels as a keyword argument, so the recomputation in backward takes it too;
    # prompts that start alike share those tokens, whose gradient must be counted once
    sdpa, prefix = _pair(tiny_model_dir)
    for model in (sdpa, prefix):
        model.to(device).gradient_checkpointing_enable({"use_reentrant": False})
    batch = [t.to(device) for t in batch()]
    m = batch[-1]
    want, _ = completion_logprobs(sdpa, *batch, 0.8)
    got, _ = completion_logprobs(prefix, *batch, 0.8)
    (want * m).sum().backward()
    (got * m).sum().backward()
    assert torch.allclose(got[m], want[m], atol=1e-5)
    for a, b in zip(_grads(sdpa), _grads(prefix), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert any(float(g.abs().sum()) > 0 for g in _grads(prefix))


def _spy_on_masks(monkeypatch, model: nn.Module) -> list[tuple[int, bool]]:
    """(the attention mask's dims, whether a layout came) of each forward of ``model``."""
    masks = []
    forward = model.forward

    def spy(*args, **kwargs):
        masks.append((kwargs["attention_mask"].dim(), "prefix_layout" in kwargs))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    return masks


def test_attention_dropout_in_training_takes_the_mask(tiny_model_dir, monkeypatch) -> None:
    _, prefix = _pair(tiny_model_dir, attention_dropout=0.5)
    masks = _spy_on_masks(monkeypatch, prefix)
    completion_logprobs(prefix, *_batch())
    prefix.eval()  # no dropout outside training: the layout again
    completion_logprobs(prefix, *_batch())
    # the update's forward: training, dropout zeroed in the modules (model.disable_dropout)
    # while the checkpoint's config still says 0.5
    disable_dropout(prefix.train())
    assert prefix.config.attention_dropout == 0.5
    completion_logprobs(prefix, *_batch())
    assert masks == [(4, False), (2, True), (2, True)]


def test_a_dropout_module_in_attention_takes_the_mask(monkeypatch) -> None:
    # GPT-2 keeps its attention dropout as a module (attn_dropout), not as a float
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=32, attn_pdrop=0.5)
    model = GPT2LMHeadModel(config).train()
    assert use_prefix_attention(model)
    masks = _spy_on_masks(monkeypatch, model)
    got, _ = completion_logprobs(model, *_batch())  # the layout would refuse the dropout
    disable_dropout(model)
    want, _ = completion_logprobs(model, *_batch())
    assert masks == [(4, False), (2, True)]
    m = _batch()[-1]
    assert not torch.allclose(got[m], want[m], atol=1e-3)  # the first really dropped weights


def test_only_attention_dropout_keeps_packed_scoring_off_the_layout() -> None:
    # GPT-2's embedding, residual and MLP dropout do not reach the attention: the layout stays
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=32, attn_pdrop=0.0)
    config.resid_pdrop = config.embd_pdrop = 0.5
    assert not attention_dropout_on(GPT2LMHeadModel(config).train())
    # Falcon keeps its attention dropout as a float on its attention (transformers 5.25; a
    # module named attention_dropout before)
    config = FalconConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=32)
    config.attention_dropout, config.hidden_dropout = 0.5, 0.0
    model = FalconForCausalLM(config).train()
    assert attention_dropout_on(model) and not attention_dropout_on(model.eval())
    disable_dropout(model.train())
    assert not attention_dropout_on(model)


def test_a_dropout_module_named_for_attention_counts_as_attention_dropout() -> None:
    # "attention_dropout" or "attn_drop" as a module name (the names HF layers have used), not
    # an MLP's dropout; a module holding one is not itself read as a rate
    class Attention(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.add_module(name, torch.nn.Dropout(0.5))

    for name, counts in [("attention_dropout", True), ("attn_drop", True), ("mlp_drop", False)]:
        model = torch.nn.Sequential(Attention(name)).train()
        assert attention_dropout_on(model) is counts, name


def test_the_layout_forward_builds_no_mask(tiny_model_dir, monkeypatch) -> None:
    # given no mask, transformers would read the packed sequences from the restarting position
    # ids and build their [U, 1, L, L] block mask: the memory prefix attention is there to save
    _, prefix = _pair(tiny_model_dir)
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return prefix_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, PREFIX, spy)
    completion_logprobs(prefix, *_batch())
    assert len(seen) == prefix.config.num_hidden_layers and all(m is None for m in seen)


def test_the_layout_forward_is_one_sequence_without_padding(tiny_model_dir, monkeypatch) -> None:
    # groups of different lengths end to end, the prompts' shared start once: as a sequence per
    # group the shorter ones would be padded to the longest, every prompt would carry the
    # shared tokens, and the head would run on each sequence's whole tail
    sdpa, prefix = _pair(tiny_model_dir)
    calls = []
    forward = prefix.forward

    def spy(*args, **kwargs):
        calls.append((kwargs["input_ids"], kwargs["logits_to_keep"]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(prefix, "forward", spy)
    batch = _shared_batch()
    got, _ = completion_logprobs(prefix, *batch)
    want, _ = completion_logprobs(sdpa, *batch)  # a sequence per group, dense mask
    ((ids, keep),) = calls
    # [5, 6] once; then 9 and the bodies 15 16 17, 19; 7 8 and 11 12 (14 has none); 7 10, 21
    assert ids.tolist() == [[5, 6, 9, 15, 16, 17, 19, 7, 8, 11, 12, 7, 10, 21]]
    # each prompt's last token (9, 8, 10) and the bodies
    assert keep.tolist() == [2, 3, 4, 5, 6, 8, 9, 10, 12, 13]
    m = batch[-1]
    assert torch.allclose(got[m], want[m], atol=1e-5)


def test_packed_scoring_defaults_to_temperature_one_without_entropy(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    logp, entropy = packed_logprobs(model, *_batch())
    want, _ = completion_logprobs(model, *_batch(), 1.0)
    m = _batch()[-1]
    assert entropy is None and torch.allclose(logp[m], want[m], atol=1e-5)


def test_a_model_that_drops_the_layout_is_an_error_not_wrong_numbers(tiny_model_dir) -> None:
    _, prefix = _pair(tiny_model_dir)

    class Swallows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.config = prefix, prefix.config

        def forward(self, prefix_layout=None, **kwargs):
            return self.inner(**kwargs)

    message = (
        "Swallows does not pass keyword arguments to its attention, so packed scoring cannot use "
        "prefix attention: load it with attn_implementation='sdpa'"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        completion_logprobs(Swallows(), *_batch())


def test_generation_and_other_models_are_unchanged(tiny_model_dir) -> None:
    sdpa, prefix = _pair(tiny_model_dir)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    config = RolloutConfig(group_size=3, max_new_tokens=8)
    outs = [
        HFEngine(model.eval(), tokenizer, config).generate(["ab", "abcd"], [{}, {}], 3, [1, 2])
        for model in (sdpa, prefix)
    ]
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)
    assert torch.allclose(outs[0].sampler_logp, outs[1].sampler_logp, atol=1e-6)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert not use_prefix_attention(eager) and eager.config._attn_implementation == "eager"
    # the trainer's policy (and so its reference copy) is switched, LoRA too
    for lora in (False, True):
        policy = load_policy(ModelConfig(lora={"enabled": lora}), str(tiny_model_dir))
        assert policy.config._attn_implementation == PREFIX


@BATCHES
def test_one_token_completions_only(tiny_model_dir, batch) -> None:
    # a completion's last token predicts nothing, so these pack to the prompts alone
    sdpa, prefix = _pair(tiny_model_dir)
    prompt_ids, prompt_mask, completion_ids, _ = batch()
    completion_mask = torch.zeros_like(completion_ids, dtype=torch.bool)
    completion_mask[:, 0] = True
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    want, _ = completion_logprobs(sdpa, *batch)
    got, _ = completion_logprobs(prefix, *batch)
    assert torch.allclose(got[:, 0], want[:, 0], atol=1e-5)


def test_prompts_and_rows_attend_through_sdpa(tiny_model_dir, monkeypatch) -> None:
    # SDPA keeps no scores for backward; the same numbers as the dense mask, gradients too
    from grpo.scoring import prefix_attention

    sdpa_calls = []
    original = prefix_attention.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        sdpa_calls.append(kwargs["attn_mask"].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(prefix_attention.F, "scaled_dot_product_attention", spy)
    sdpa, prefix = _pair(tiny_model_dir)
    batch = _batch()
    m = batch[-1]
    want, _ = completion_logprobs(sdpa, *batch, 0.8)
    sdpa_calls.clear()  # the dense-mask path above calls SDPA too
    got, _ = completion_logprobs(prefix, *batch, 0.8)
    assert len(sdpa_calls) == 2 * 2  # prompts and completion rows, in each of the 2 layers
    (want * m).sum().backward()
    (got * m).sum().backward()
    assert torch.allclose(got[m], want[m], atol=1e-5)
    for a, b in zip(_grads(sdpa), _grads(prefix), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("own_head", [False, True])
def test_a_model_that_ignores_logits_to_keep_is_refused(
    tiny_model_dir, monkeypatch, own_head: bool
) -> None:
    # scored at every position instead of the ones asked for, its log-probs would be read off
    # the wrong positions without a word
    import grpo.scoring.chunked_head as chunked_head

    _, prefix = _pair(tiny_model_dir)
    forward = prefix.forward

    def ignores(*args, **kwargs):
        kwargs["logits_to_keep"] = 0
        return forward(*args, **kwargs)

    monkeypatch.setattr(prefix, "forward", ignores)
    if own_head:
        monkeypatch.setattr(chunked_head, "head_slot", lambda model: None)
    said = (
        rf"^{type(prefix).__name__} computed \d+ positions' logits where logits_to_keep asked "
        r"for \d+: its forward does not honour logits_to_keep, so it cannot be scored packed$"
    )
    with pytest.raises(RuntimeError, match=said):
        completion_logprobs(prefix, *_shared_batch())


@pytest.mark.device
@BATCHES
def test_prefix_scoring_under_bf16_autocast_equals_the_masked_one(tiny_model_dir, device, batch):
    # under autocast attention returns bf16 for float32 queries (on CUDA): the scatter of the
    # real positions takes the attention's dtype, and both paths agree to bf16's precision
    sdpa, prefix = _pair(tiny_model_dir)
    batch = [t.to(device) for t in batch()]
    m = batch[-1]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        want, _ = completion_logprobs(sdpa.to(device), *batch, 0.8)
        got, _ = completion_logprobs(prefix.to(device), *batch, 0.8)
    assert got.dtype == torch.float32
    assert torch.allclose(got[m], want[m], atol=0.1)


def test_under_bf16_autocast_a_cpu_attends_in_float32(tiny_model_dir, monkeypatch) -> None:
    # SDPA's CPU kernel is faster in float32 than in bf16 at these shapes, and CPU autocast runs
    # it in bf16 whatever its inputs: grpo turns autocast off around it
    _, prefix = _pair(tiny_model_dir)
    batch = _batch()
    m = batch[-1]
    ran: list[torch.dtype] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        ran.append(out.dtype)  # autocast casts inside the call: the output says what ran
        return out

    def scored(upcast: bool):
        chooser = prefix_attention.in_float32
        monkeypatch.setattr(prefix_attention, "in_float32", lambda q: upcast and chooser(q))
        monkeypatch.setattr(prefix_attention.F, "scaled_dot_product_attention", spy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = completion_logprobs(prefix, *batch)
            (logp * m).sum().backward()
        monkeypatch.undo()
        grads = _grads(prefix)
        prefix.zero_grad(set_to_none=True)
        return logp.detach(), grads

    want, _ = completion_logprobs(prefix, *batch)  # float32 throughout
    upcast, upcast_grads = scored(True)
    assert ran and set(ran) == {torch.float32}
    ran.clear()
    kept, _ = scored(False)
    assert ran and set(ran) == {torch.bfloat16}
    assert not torch.equal(upcast[m], kept[m])  # the knob changes the numbers
    for got in (upcast, kept):  # both near the float32 model's, by bf16 products' rounding
        assert float((got[m] - want[m].detach()).abs().max()) < 0.1
    assert all(torch.isfinite(g).all() for g in upcast_grads)
    assert any(float(g.abs().sum()) > 0 for g in upcast_grads)
