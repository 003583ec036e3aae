"""Speed levers must not change results: each fast path against the plain one it replaces."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

from grpo.config import RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout import completion_mask_and_truncation
from grpo.rollout.hf import HFEngine, SeededGroupSampler, sample_groups


@pytest.mark.parametrize("eos_bias", [0.0, 2.0])
def test_prefill_once_samples_what_generate_samples(tiny_model_dir, eos_bias: float) -> None:
    # the prompt is prefilled once per group and its cache repeated G times, and finished rows
    # leave the batch; with the same seeded sampler, every token must equal what generate() draws
    # from G separate prefills. A bias on EOS makes rows finish at different steps.
    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = HFEngine(model, tok, RolloutConfig(max_new_tokens=16, temperature=0.7, top_k=20))
    enc = tok(["a", "a much longer prompt", "mid prompt"], return_tensors="pt", padding=True)
    g, seeds = 4, [11, 12, 13]

    def bias_eos(_: object, scores: torch.Tensor) -> torch.Tensor:
        return scores + eos_bias * (torch.arange(scores.shape[1]) == tok.eos_token_id)

    def processors() -> LogitsProcessorList:
        sampler = SeededGroupSampler(seeds, g, model.device)
        return LogitsProcessorList([bias_eos, *engine.warpers, sampler])

    with torch.no_grad():
        plain = model.generate(
            input_ids=enc.input_ids.repeat_interleave(g, dim=0),
            attention_mask=enc.attention_mask.repeat_interleave(g, dim=0),
            generation_config=GenerationConfig(
                do_sample=False,
                max_new_tokens=16,
                pad_token_id=tok.pad_token_id,
                eos_token_id=engine.eos,
            ),
            logits_processor=processors(),
        )[:, enc.input_ids.shape[1] :]
        fast = sample_groups(
            model,
            enc.input_ids,
            enc.attention_mask,
            g,
            processors(),
            16,
            engine.eos,
            tok.pad_token_id,
        )
    mask, _ = completion_mask_and_truncation(plain, engine.eos)
    plain = plain.masked_fill(~mask, tok.pad_token_id)
    assert fast.shape == plain.shape == (12, plain.shape[1])
    assert torch.equal(fast, plain)
    if eos_bias:  # rows really did finish apart, so the batch shrank along the way
        lengths = mask.sum(dim=1)
        assert int((lengths < lengths.max() // 2).sum()) >= 3


def test_sample_groups_stops_when_every_row_has_finished(tiny_model_dir) -> None:
    # a processor that forces EOS at the 3rd token: the loop must stop after 3 tokens, not 16
    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eos = tok.eos_token_id
    calls = []

    def eos_on_third(_: object, scores: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        forced = torch.full_like(scores, -1e9)
        forced[:, 7 if len(calls) < 3 else eos] = 0.0
        return forced

    enc = tok(["ab", "abc"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = sample_groups(model, enc.input_ids, enc.attention_mask, 2, eos_on_third, 16, [eos], 0)
    assert out.tolist() == [[7, 7, eos]] * 4


def test_micro_batch_order_takes_the_cheaper_of_length_and_group_order() -> None:
    from grpo.trainer import forward_tokens, micro_batch_order

    # 2 groups of 2, micro-batches of 2; completions 1, 9 (group 0) and 2, 8 (group 1)
    completion = torch.tensor([1, 9, 2, 8])
    long_prompt = torch.full((4,), 10)
    # longest first: {9, 8} pays 2 prompts + 2 x 9 = 38, {2, 1} pays 2 x 10 + 2 x 2 = 24 -> 62
    assert forward_tokens(torch.tensor([1, 3, 2, 0]), long_prompt, completion, 2, 2) == 62
    # by group: {9, 1} pays 10 + 2 x 9 = 28, {8, 2} pays 10 + 2 x 8 = 26 -> 54: groups win
    assert micro_batch_order(long_prompt, completion, 2, 2).tolist() == [1, 0, 3, 2]
    # with 1-token prompts: longest first 2 + 18 + 2 + 4 = 26 beats groups 19 + 17 = 36
    short_prompt = torch.ones(4, dtype=torch.long)
    assert micro_batch_order(short_prompt, completion, 2, 2).tolist() == [1, 3, 2, 0]
