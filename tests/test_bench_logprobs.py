"""The shared-prompt log-prob path equals the full-sequence path, values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.logprobs import completion_logprobs, full_sequence_logprobs, shared_prompt_logprobs


def _batch():
    # 3 distinct prompts (two left padded), 6 completions (two right padded); rows 0, 1, 5 share
    # prompt 0 and rows 2, 4 share prompt 1
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
    return prompts, prompt_mask, rows, completions, completion_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_matches_full_sequences(tiny_model_dir, temperature: float) -> None:
    plain_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    shared_model = copy.deepcopy(plain_model)
    prompts, prompt_mask, rows, completions, completion_mask = _batch()
    weights = torch.randn(completions.shape, generator=torch.Generator().manual_seed(1))

    want, want_entropy = full_sequence_logprobs(
        plain_model,
        prompts[rows],
        prompt_mask[rows],
        completions,
        completion_mask,
        temperature,
        True,
    )
    got, got_entropy = shared_prompt_logprobs(
        shared_model, prompts, prompt_mask, rows, completions, completion_mask, temperature, True
    )
    m = completion_mask
    assert torch.allclose(got[m], want[m], atol=1e-5)
    assert torch.allclose(got_entropy[m], want_entropy[m], atol=1e-5)
    # a loss over unmasked tokens: the gradient reaching every weight (through the gathered
    # prompt cache too) must be the one the full sequences give
    (want * weights * m).sum().backward()
    (got * weights * m).sum().backward()
    for (name, a), (_, b) in zip(
        plain_model.named_parameters(), shared_model.named_parameters(), strict=True
    ):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def test_dispatch_uses_shared_path_only_when_prompts_repeat(tiny_model_dir, monkeypatch) -> None:
    import grpo.logprobs as logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts, prompt_mask, rows, completions, completion_mask = _batch()
    calls = []
    real = logprobs.shared_prompt_logprobs
    monkeypatch.setattr(
        logprobs, "shared_prompt_logprobs", lambda *a, **k: calls.append(a[3]) or real(*a, **k)
    )
    with torch.no_grad():
        completion_logprobs(model, prompts[rows], prompt_mask[rows], completions, completion_mask)
        assert len(calls) == 1 and len(torch.unique(calls[0])) == 3  # 6 rows, 3 prompts
        completion_logprobs(model, prompts, prompt_mask, completions[:3], completion_mask[:3])
        assert len(calls) == 1  # all prompts distinct: one full forward, no cache
        model.activation_checkpointing_enable()
        completion_logprobs(model, prompts[rows], prompt_mask[rows], completions, completion_mask)
        assert len(calls) == 1  # checkpointing disables the cache the shared path needs
