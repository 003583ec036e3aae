"""Packed log-probs (each prompt once, then its completions) equal one full sequence per row,
values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.scoring.distribution import Decoding
from grpo.scoring.logprobs import completion_logprobs, full_sequence_logprobs
from grpo.scoring.packing import pack
from grpo.scoring.prefix_attention import PREFIX


def _batch():
    # 3 distinct prompts (two left padded), 6 completions (right padded, one of a single token);
    # rows 0, 1, 5 share prompt 0 and rows 2, 4 share prompt 1
    gen = torch.Generator().manual_seed(0)
    s, t = 7, 5
    prompts = torch.randint(10, 90, (3, s), generator=gen)
    prompt_mask = torch.ones(3, s, dtype=torch.bool)
    prompt_mask[1, :3] = False
    prompt_mask[2, :1] = False
    prompts = prompts.masked_fill(~prompt_mask, 0)
    rows = torch.tensor([0, 0, 1, 2, 1, 0])
    completions = torch.randint(10, 90, (6, t), generator=gen)
    completion_mask = torch.ones(6, t, dtype=torch.bool)
    completion_mask[1, 3:] = False
    completion_mask[4, 1:] = False
    return prompts[rows], prompt_mask[rows], completions, completion_mask


@pytest.mark.parametrize(
    ("temperature", "attention"),
    [
        (1.0, "sdpa"),
        (0.7, "sdpa"),
        (0.7, "eager"),
        # a penalty reads each row's history (its prompt and completion so far) on both paths
        (Decoding(temperature=0.7, repetition_penalty=1.3, top_k=20), "sdpa"),
        # no mask: each completion attends to its prompt and itself (grpo.scoring.prefix_attention)
        (0.7, PREFIX),
        (Decoding(temperature=0.7, repetition_penalty=1.3, top_k=20), PREFIX),
    ],
)
def test_packed_matches_full_sequences(
    tiny_model_dir, temperature: float | Decoding, attention: str
) -> None:
    plain_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    packed_model = copy.deepcopy(plain_model)
    packed_model.config._attn_implementation = attention
    batch = _batch()
    m = batch[-1]
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(1))

    want, want_entropy = full_sequence_logprobs(plain_model, *batch, temperature, True)
    got, got_entropy = completion_logprobs(packed_model, *batch, temperature, True)
    assert torch.allclose(got[m], want[m], atol=1e-5)
    assert torch.allclose(got_entropy[m], want_entropy[m], atol=1e-5)
    # a loss over unmasked tokens: the gradient reaching every weight (through the shared prompt
    # positions too) must be the one the full sequences give
    (want * weights * m).sum().backward()
    (got * weights * m).sum().backward()
    for (name, a), (_, b) in zip(
        plain_model.named_parameters(), packed_model.named_parameters(), strict=True
    ):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def test_pack_computes_each_prompt_once_and_no_completion_padding() -> None:
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch()
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask)
    # 3 sequences: prompt 0 (7 tokens) + rows 0, 1, 5 (5, 3, 5 tokens, each less its last one)
    # = 7 + 4 + 2 + 4 = 17; prompt 1 (4) + rows 2, 4 (5, 1) = 4 + 4 + 0 = 8; prompt 2 (6) + row 3 (5)
    assert packed.input_ids.shape == (3, 17)
    real = (packed.segment >= 0).sum(dim=1)
    assert sorted(real.tolist()) == [8, 10, 17]
    # the kept positions run from each prompt's last token to the end: 17 - 7 + 1 = 11
    assert packed.keep == 11
    mask = packed.attention_mask(torch.bool)[:, 0]
    seq = int(real.argmax())  # prompt 0's sequence, no padding
    seg = packed.segment[seq]
    first, second = (seg == 1).nonzero()[0, 0], (seg == 2).nonzero()[0, 0]
    assert mask[seq, second, :7].all()  # completions see the whole prompt
    assert not mask[seq, second, first : first + 4].any()  # and not another completion
    assert not mask[seq, 3, 4:].any()  # the prompt is causal


def test_windowed_models_and_attention_without_custom_masks_get_full_sequences(
    tiny_model_dir, monkeypatch
) -> None:
    import grpo.scoring.logprobs as logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    calls = []
    monkeypatch.setattr(
        logprobs, "full_sequence_logprobs", lambda *a, **k: calls.append(1) or (None, None)
    )
    with torch.no_grad():
        completion_logprobs(model, *_batch())
        assert calls == []
        model.config.sliding_window = 4  # the packed mask would ignore the window
        completion_logprobs(model, *_batch())
        assert calls == [1]
        model.config.sliding_window = None
        model.config._attn_implementation = "flash_attention_2"
        completion_logprobs(model, *_batch())
        assert calls == [1, 1]
