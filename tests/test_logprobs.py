"""Completion log-probs against a naive full log-softmax, one unpadded sequence at a time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.logprobs import (
    completion_logprobs,
    full_sequence_logprobs,
    position_ids_from_mask,
    token_logprobs,
)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _naive(model, prompt: list[int], completion: list[int], temperature: float):
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0] / temperature  # [L, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    probs = logp.exp()
    s = len(prompt)
    picked = [logp[s - 1 + j, tok] for j, tok in enumerate(completion)]
    entropy = [-(probs[s - 1 + j] * logp[s - 1 + j]).sum() for j in range(len(completion))]
    return torch.stack(picked), torch.stack(entropy)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_log_softmax_with_padding(model, temperature: float) -> None:
    prompts = [[10, 11, 12, 13, 14], [20, 21]]
    completions = [[30, 31, 1], [40, 41, 42, 43]]
    s, t = 5, 4
    prompt_ids = torch.zeros(2, s, dtype=torch.long)
    prompt_mask = torch.zeros(2, s, dtype=torch.bool)
    completion_ids = torch.zeros(2, t, dtype=torch.long)
    completion_mask = torch.zeros(2, t, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[i, s - len(p) :] = torch.tensor(p)  # left padding
        prompt_mask[i, s - len(p) :] = True
        completion_ids[i, : len(c)] = torch.tensor(c)  # right padding
        completion_mask[i, : len(c)] = True
    with torch.no_grad():
        logp, entropy = completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, True
        )
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            want_logp, want_entropy = _naive(model, p, c, temperature)
            assert torch.allclose(logp[i, : len(c)], want_logp, atol=1e-5)
            assert torch.allclose(entropy[i, : len(c)], want_entropy, atol=1e-5)


def test_token_logprobs_chunking_is_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(15, 11, generator=gen)
    targets = torch.randint(0, 11, (5, 3), generator=gen)
    at = torch.randperm(15, generator=gen).view(5, 3)
    want = torch.log_softmax(logits / 0.5, dim=-1)[at, targets]
    for chunk in (1, 2, 8, 64):
        got, _ = token_logprobs(logits, at, targets, 0.5, chunk=chunk)
        assert torch.allclose(got, want, atol=1e-6)


def test_lm_head_runs_only_on_completion_positions(model) -> None:
    seen = {}
    original = model.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen["logits"] = tuple(out.logits.shape)
        return out

    model.forward = spy
    try:
        ids = torch.arange(1, 22).view(3, 7)
        completion_logprobs(
            model,
            ids,
            torch.ones(3, 7, dtype=torch.bool),
            ids[:, :4],
            torch.ones(3, 4, dtype=torch.bool),
        )
    finally:
        del model.forward
    # each sequence packs 7 prompt + 3 completion tokens (the last predicts nothing); 4 completion
    # tokens need 4 predicting positions, not 10
    assert seen["logits"][:2] == (3, 4)


def test_position_ids_skip_left_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_full_sequences_default_to_temperature_one_without_entropy(model) -> None:
    prompt_ids = torch.tensor([[10, 11, 12]])
    prompt_mask = torch.ones(1, 3, dtype=torch.bool)
    completion_ids = torch.tensor([[20, 21]])
    completion_mask = torch.ones(1, 2, dtype=torch.bool)
    args = (model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    with torch.no_grad():
        default, entropy = full_sequence_logprobs(*args)
        at_one, _ = full_sequence_logprobs(*args, 1.0)
    assert entropy is None
    assert torch.equal(default, at_one)
    expected, _ = _naive(model, [10, 11, 12], [20, 21], 1.0)
    assert torch.allclose(default[0], expected, atol=1e-5)


def _gpt2(vocab: int) -> torch.nn.Module:
    """A tiny GPT-2: absolute position embeddings, so a wrong position id changes the output."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_full_sequences_with_padding_match_each_row_alone(model, which: str) -> None:
    net = model if which == "llama" else _gpt2(model.config.vocab_size)
    prompts, completions = [[10, 11, 12, 13, 14], [20, 21]], [[30, 31, 32], [40]]
    s, t = 5, 3
    prompt_ids = torch.zeros(2, s, dtype=torch.long)
    prompt_mask = torch.zeros(2, s, dtype=torch.bool)
    completion_ids = torch.zeros(2, t, dtype=torch.long)
    completion_mask = torch.zeros(2, t, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[i, s - len(p) :], prompt_mask[i, s - len(p) :] = torch.tensor(p), True
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = torch.tensor(c), True
    with torch.no_grad():
        logp, _ = full_sequence_logprobs(
            net, prompt_ids, prompt_mask, completion_ids, completion_mask
        )
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            expected, _ = _naive(net, p, c, 1.0)
            assert torch.allclose(logp[i, : len(c)], expected, atol=1e-5), i
