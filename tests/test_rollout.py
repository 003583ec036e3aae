"""HF rollout: grouping, padding, EOS masking, truncation flags, chat templates."""

from __future__ import annotations

import torch

from grpo.config import RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout import completion_mask_and_truncation, render_prompt
from grpo.rollout.hf import HFEngine


def test_mask_stops_after_first_eos() -> None:
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]])
    mask, truncated = completion_mask_and_truncation(ids, [2])
    assert mask.tolist() == [
        [True, True, True, False, False],  # EOS itself counts, what follows does not
        [True] * 5,  # no EOS: every token counts, and the completion is truncated
        [True, False, False, False, False],
    ]
    assert truncated.tolist() == [False, True, False]


def test_chat_template_and_plain_prompts(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    text = render_prompt(tok, "1+1?", "Be brief.")
    assert text == "<|system|>Be brief.<|end|><|user|>1+1?<|end|><|assistant|>"
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(tok, messages, None) == "<|user|>hi<|end|><|assistant|>"
    tok.chat_template = None
    assert render_prompt(tok, "1+1?", "Be brief.") == "Be brief.\n\n1+1?\n"


def test_generate_groups_padding_and_masks(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, tok, RolloutConfig(max_new_tokens=6, temperature=1.0))
    prompts = ["a", "a much longer prompt"]
    torch.manual_seed(0)
    out = engine.generate(prompts, [{"prompt": p} for p in prompts], group_size=3)
    assert out.completion_ids.shape[0] == 6 and out.completion_ids.shape[1] <= 6
    assert out.prompts == ["a"] * 3 + ["a much longer prompt"] * 3  # groups are contiguous
    # left padding: the short prompt's first columns are padding, its last column is real
    assert not out.prompt_mask[0, 0] and out.prompt_mask[0, -1] and out.prompt_mask[3].all()
    lengths = out.completion_mask.sum(dim=1)
    eos = tok.eos_token_id
    for i in range(6):
        n = int(lengths[i])
        assert out.completion_mask[i, :n].all() and not out.completion_mask[i, n:].any()
        has_eos = bool((out.completion_ids[i, :n] == eos).any())
        assert out.truncated[i].item() == (not has_eos)
        if has_eos:
            assert out.completion_ids[i, n - 1] == eos
        assert out.completions[i] == tok.decode(out.completion_ids[i, :n], skip_special_tokens=True)
