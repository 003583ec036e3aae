"""Completion log-probs against a naive full log-softmax, one unpadded sequence at a time."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_gemma3 import tiny_gemma3
from torch_calls import RowsOf
from transformers import AutoModelForCausalLM

from grpo.scoring import packing
from grpo.scoring.chunked_head import chunked_head_slot
from grpo.scoring.logprobs import (
    completion_logprobs,
    full_sequence_logprobs,
    position_ids_from_mask,
    token_logprobs,
)
from grpo.scoring.packing import pack
from grpo.scoring.prefix_attention import SHARED


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _naive(model, prompt: list[int], completion: list[int], temperature: float):
    ids = torch.tensor([prompt + completion], device=model.device)
    logits = model(input_ids=ids).logits[0] / temperature  # [L, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    probs = logp.exp()
    s = len(prompt)
    picked = [logp[s - 1 + j, tok] for j, tok in enumerate(completion)]
    entropy = [-(probs[s - 1 + j] * logp[s - 1 + j]).sum() for j in range(len(completion))]
    return torch.stack(picked), torch.stack(entropy)


@pytest.mark.device
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_log_softmax_with_padding(model, device, temperature: float) -> None:
    model = copy.deepcopy(model).to(device)
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
    batch = [t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask)]
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, *batch, temperature, True)
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            want_logp, want_entropy = _naive(model, p, c, temperature)
            assert torch.allclose(logp[i, : len(c)], want_logp, atol=1e-5)
            assert torch.allclose(entropy[i, : len(c)], want_entropy, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 2, 8, 64])
def test_token_logprobs_chunking_is_exact(chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(15, 11, generator=gen)
    targets = torch.randint(0, 11, (5, 3), generator=gen)
    at = torch.randperm(15, generator=gen).view(5, 3)
    want = torch.log_softmax(logits / 0.5, dim=-1)[at, targets]
    with RowsOf(lambda func: func is torch.logsumexp) as normalised:  # log-normalisers
        got, _ = token_logprobs(logits, at, targets, 0.5, chunk=chunk)
    assert torch.allclose(got, want, atol=1e-6)
    # the float32 temporaries are as small as asked: each position normalised once, ``chunk``
    # positions at a time
    assert normalised.rows == [min(chunk, 15 - k) for k in range(0, 15, chunk)]


def test_a_repetition_penalty_without_the_rows_history_is_a_clear_error() -> None:
    from grpo.scoring.distribution import Decoding

    logits, at = torch.zeros(4, 11), torch.arange(4).view(2, 2)
    with pytest.raises(ValueError, match="repetition_penalty needs each row's history"):
        token_logprobs(logits, at, at, Decoding(repetition_penalty=1.2))


def test_lm_head_runs_only_on_completion_positions(model) -> None:
    seen = {}
    original = model.forward

    def spy(*args, **kwargs):
        # whatever module is the head during the forward (the chunked one stands in for it)
        hook = model.lm_head.register_forward_pre_hook(
            lambda _, args: seen.update(hidden=tuple(args[0].shape))
        )
        try:
            return original(*args, **kwargs)
        finally:
            hook.remove()

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
    assert seen["hidden"][:2] == (3, 4)


def test_packing_pays_by_hand() -> None:
    from grpo.scoring.packing import ScoringCost

    cost = ScoringCost(position=1.0, pair=1.0)
    # prompt 10, two completions of 2: packed 10 + 1 + 1 = 12 -> 12 + 144 = 156;
    # rows 2 x (12 + 12^2 / 2) = 168: packing pays
    assert cost.packing_pays(10, [2, 2])
    # prompt 4, two completions of 3: packed 4 + 2 + 2 = 8 -> 8 + 64 = 72;
    # rows 2 x (7 + 49 / 2) = 63: one row per completion
    assert not cost.packing_pays(4, [3, 3])
    # prompt 4, four one-token completions (whose only token predicts nothing): packed 4 ->
    # 4 + 16 = 20; rows 4 x (5 + 25 / 2) = 70: packing pays
    assert cost.packing_pays(4, [1, 1, 1, 1])


def test_scoring_cost_reads_the_models_config() -> None:
    from transformers import GPT2Config, LlamaConfig

    from grpo.scoring.packing import ScoringCost

    llama = LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=3)
    assert ScoringCost.of(llama) == ScoringCost(
        position=2.0 * 3 * (4 * 32 * 32 + 3 * 32 * 80), pair=4.0 * 3 * 32
    )
    # GPT-2's config names no intermediate size: its MLP is 4 x hidden
    gpt2 = GPT2Config(n_embd=32, n_layer=2)
    assert ScoringCost.of(gpt2) == ScoringCost(
        position=2.0 * 2 * (4 * 32 * 32 + 3 * 32 * 128), pair=4.0 * 2 * 32
    )


def _batch(prompts, completions, s: int, t: int):
    b = len(prompts)
    prompt_ids = torch.zeros(b, s, dtype=torch.long)
    prompt_mask = torch.zeros(b, s, dtype=torch.bool)
    completion_ids = torch.zeros(b, t, dtype=torch.long)
    completion_mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[i, s - len(p) :] = torch.tensor(p)
        prompt_mask[i, s - len(p) :] = True
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = True
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.device
@pytest.mark.parametrize("penalised", [False, True])
def test_groups_scored_per_row_match_packed_and_padded(model, device, monkeypatch, penalised):
    # group A (prompt of 5) is packed, group B (prompt of 3) scored one row per completion:
    # values and gradients equal one padded sequence per row (also under a repetition penalty
    # and top-k, which read each row's history)
    from grpo.scoring import logprobs
    from grpo.scoring.distribution import Decoding

    decoding = Decoding(0.7, top_k=20, repetition_penalty=1.3) if penalised else 0.7

    monkeypatch.setattr(
        packing.ScoringCost, "packing_pays", lambda self, prompt_len, lens: prompt_len > 3
    )
    a, b = [10, 11, 12, 13, 14], [20, 21, 22]
    prompts = [a, b, a, b]
    completions = [[30, 31, 1], [40, 41, 42, 43], [32], [44, 45]]
    batch = [t.to(device) for t in _batch(prompts, completions, s=5, t=4)]
    mask = batch[3]
    model = copy.deepcopy(model).to(device)
    model.zero_grad()
    mixed, entropy = completion_logprobs(model, *batch, decoding, with_entropy=True)
    (mixed * mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    padded, want_entropy = logprobs.full_sequence_logprobs(model, *batch, decoding, True)
    (padded * mask).sum().backward()
    assert torch.allclose(mixed[mask], padded[mask], atol=1e-5)
    assert torch.allclose(entropy[mask], want_entropy[mask], atol=1e-5)
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    model.zero_grad()


def test_long_completions_build_no_square_mask(model, monkeypatch) -> None:
    # two completions of 200 after a 5-token prompt: the rule gives each its own row, and the
    # model is called without any attention mask (plain causal attention, linear memory)
    from grpo.scoring.packing import ScoringCost

    with torch.no_grad():
        want, _ = _naive(model, [10, 11, 12, 13, 14], [31] * 150, 1.0)
    calls = []
    original = model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("attention_mask"))
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    assert not ScoringCost.of(model.config).packing_pays(5, [200, 200])
    batch = _batch([[10, 11, 12, 13, 14]] * 2, [[30] * 200, [31] * 150], s=5, t=200)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, *batch)
    assert calls == [None]
    assert torch.allclose(logp[1, :150], want, atol=1e-5)


def test_scoring_path_says_why() -> None:
    from types import SimpleNamespace

    from grpo.scoring.logprobs import scoring_path

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert scoring_path(model(_attn_implementation="sdpa")) == (
        "packed",
        "sdpa attention takes a custom mask; a group switches to one row per completion when "
        "packing costs more (long completions)",
    )
    path, why = scoring_path(model(_attn_implementation="flash_attention_2"))
    assert (path, why) == ("rows", "flash_attention_2 attention takes no custom mask")
    path, why = scoring_path(model(_attn_implementation="sdpa", sliding_window=4096))
    assert (path, why) == (
        "packed",
        "sdpa attention takes a custom mask; with a sliding window of 4096: packed while every "
        "sequence of a batch fits in it, else one padded row per completion; a group switches "
        "to one row per completion when packing costs more (long completions)",
    )


def _tiny_gemma3(window: int):
    from grpo.scoring.prefix_attention import use_prefix_attention

    model = tiny_gemma3(window)
    assert use_prefix_attention(model)
    return model


@pytest.mark.parametrize(
    ("window", "packed"),
    [(32, True), (9, True), (8, False), (6, False)],
    ids=["fits", "equal", "one-short", "outgrown"],
)
def test_a_sliding_window_model_is_packed_while_its_sequences_fit(
    window: int, packed: bool, monkeypatch
) -> None:
    # Gemma 3's local layers: a window at least as long as every sequence excludes no key, so
    # the packed layout (which replaces the model's masks) is exact; a longer sequence falls
    # back to one padded row per completion under the model's own masks. Either way the
    # log-probs are those of a plain forward over each unpadded sequence
    import grpo.scoring.logprobs as logprobs

    model = _tiny_gemma3(window)
    rows_path = []
    full = logprobs.full_sequence_logprobs
    monkeypatch.setattr(
        logprobs, "full_sequence_logprobs", lambda *a, **k: rows_path.append(1) or full(*a, **k)
    )
    prompts = [[1, 5, 6, 7], [1, 8]]
    completions = [[10, 11, 12, 13, 14], [15, 16], [17, 18, 19], [20]]
    rows = [(prompts[i // 2], c) for i, c in enumerate(completions)]
    prompt_ids = torch.tensor([[0] * (4 - len(p)) + p for p, _ in rows])
    prompt_mask = prompt_ids != 0
    completion_ids = torch.tensor([c + [0] * (5 - len(c)) for _, c in rows])
    completion_mask = torch.tensor([[j < len(c) for j in range(5)] for _, c in rows])
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask
        )
        for i, (p, c) in enumerate(rows):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(logp[i, : len(c)], want, atol=1e-5, rtol=0)
    # "fits" is per sequence: the longest prompt (4) plus the longest completion (5) is 9
    # positions, packed under a window of 32 or exactly 9, one row each under 8 or 6, though
    # the batch holds 12 prompt and 11 completion tokens in all
    assert bool(rows_path) is not packed


def test_packed_scoring_takes_a_window_as_long_as_its_longest_sequence() -> None:
    # the packed layout replaces the model's masks, its sliding window included. The longest
    # packed sequence here is a 4-token prompt and 4 of its completion's 5 tokens (the last
    # predicts nothing): 8 positions. A window of 8 excludes no key, so the packed log-probs are
    # the plain forward's; a window of 7 would hide position 0 from position 7, which the layout
    # lets it read, so the forward refuses instead of returning log-probs that ignore the window
    from grpo.scoring.packing import packed_logprobs

    prompts = [[1, 5, 6, 7], [1, 8]]
    completions = [[10, 11, 12, 13, 14], [15, 16], [17, 18, 19], [20]]
    rows = [(prompts[i // 2], c) for i, c in enumerate(completions)]
    prompt_ids = torch.tensor([[0] * (4 - len(p)) + p for p, _ in rows])
    completion_ids = torch.tensor([c + [0] * (5 - len(c)) for _, c in rows])
    completion_mask = torch.tensor([[j < len(c) for j in range(5)] for _, c in rows])
    batch = (prompt_ids, prompt_ids != 0, completion_ids, completion_mask)
    model = _tiny_gemma3(8)
    with torch.no_grad():
        logp, _ = packed_logprobs(model, *batch)
        for i, (p, c) in enumerate(rows):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(logp[i, : len(c)], want, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="sliding window shorter than the sequences"):
            packed_logprobs(_tiny_gemma3(7), *batch)


def test_the_trainer_prints_its_scoring_path(tiny_config, capsys) -> None:
    from grpo.training.trainer import Trainer

    Trainer(tiny_config())
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("scoring")]
    assert lines == [
        "scoring log-probs: packed (prefix attention: each completion reads its prompt and its "
        "own tokens, no [L, L] mask; a group switches to one row per completion when packing "
        "costs more (long completions)); LM head: a chunk at a time"
    ]
    trainer = Trainer(tiny_config(model={"chunked_head": False}, algorithm={"beta": 0.04}))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("scoring")]
    assert lines[0].endswith("; LM head: full logits")
    # the policy and the reference's frozen copy both score from full logits
    assert chunked_head_slot(trainer.state.policy) is None
    assert chunked_head_slot(trainer.state.reference.copy) is None


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


def _padded_batch() -> tuple[torch.Tensor, ...]:
    prompt_ids = torch.tensor([[0, 10, 11, 12], [20, 21, 22, 23]])
    prompt_mask = torch.tensor([[False, True, True, True], [True, True, True, True]])
    completion_ids = torch.tensor([[30, 31, 0], [40, 41, 42]])
    completion_mask = torch.tensor([[True, True, False], [True, True, True]])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_completion_logprobs_defaults_and_the_windowed_path(tiny_model_dir, monkeypatch) -> None:
    import grpo.scoring.logprobs as logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    batch = _padded_batch()
    mask = batch[3]
    with torch.no_grad():
        packed, entropy = completion_logprobs(model, *batch)  # defaults: T 1, no entropy
        at_one, _ = completion_logprobs(model, *batch, 1.0)
        full, _ = full_sequence_logprobs(model, *batch)
        assert entropy is None and torch.equal(packed, at_one)
        assert torch.allclose(packed[mask], full[mask], atol=1e-5)
        # a sliding window sends the batch through full sequences, arguments and all
        model.config.sliding_window = 4
        windowed = completion_logprobs(model, *batch, 0.7, with_entropy=True)
        expected = full_sequence_logprobs(model, *batch, 0.7, with_entropy=True)
    assert torch.equal(windowed[0], expected[0]) and torch.equal(windowed[1], expected[1])
    # a window the config turns off (Qwen2's use_sliding_window: false) packs again
    calls = []
    monkeypatch.setattr(
        logprobs, "full_sequence_logprobs", lambda *a, **k: calls.append(1) or (None, None)
    )
    model.config.use_sliding_window = False
    with torch.no_grad():
        completion_logprobs(model, *batch)
    assert calls == []


class _Wrapper(torch.nn.Module):
    """A DDP-like wrapper: the model (and its config) on ``.module``, or no config at all."""

    def __init__(self, model: torch.nn.Module, expose: bool) -> None:
        super().__init__()
        if expose:
            self.module = model
        else:
            self.inner = model

    def forward(self, **kwargs):
        return (self.module if hasattr(self, "module") else self.inner)(**kwargs)


def test_wrapped_models_pack_and_models_without_a_config_do_not(tiny_model_dir, monkeypatch):
    import grpo.scoring.logprobs as logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    calls = []
    monkeypatch.setattr(
        logprobs, "full_sequence_logprobs", lambda *a, **k: calls.append(1) or (None, None)
    )
    with torch.no_grad():
        completion_logprobs(_Wrapper(model, expose=True), *_padded_batch())
        assert calls == []  # the config is found on .module: packed
        completion_logprobs(_Wrapper(model, expose=False), *_padded_batch())
        assert calls == [1]  # no config: nothing says a custom mask is safe


def test_more_prompts_than_packed_positions_under_a_repetition_penalty(model) -> None:
    # four prompts of 2 or 3 tokens, each with a one-token completion: more packed sequences (4)
    # than tokens in the longest (3), so the penalty's per-position owners must be counted by
    # sequences x kept positions, not by length
    from grpo.scoring.distribution import Decoding
    from grpo.scoring.packing import packed_logprobs

    prompts = [[10, 11], [12, 13, 14], [15, 16], [17, 18, 10]]
    completions = [[11], [20], [16], [18]]  # 11, 16, 18 repeat a prompt token
    batch = _batch(prompts, completions, s=3, t=1)
    penalty = 1.5
    with torch.no_grad():
        logp, _ = packed_logprobs(model, *batch, Decoding(repetition_penalty=penalty))
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            logits = model(input_ids=torch.tensor([p])).logits[0, -1].float()
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[p] = True
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            want = torch.log_softmax(torch.where(seen, scaled, logits), dim=-1)[c[0]]
            assert torch.allclose(logp[i, 0], want, atol=1e-5), i


def test_token_logprobs_at_temperature_two() -> None:
    # logits 0 and 2 ln 2; at T = 2 they are 0 and ln 2: p = 1/3, 2/3;
    # entropy -(1/3 ln 1/3 + 2/3 ln 2/3) = ln 3 - (2/3) ln 2
    logits = torch.tensor([[0.0, 2 * math.log(2)]])
    at, targets = torch.tensor([[0, 0]]), torch.tensor([[0, 1]])
    logp, entropy = token_logprobs(logits, at, targets, 2.0, with_entropy=True)
    assert torch.allclose(logp, torch.tensor([[math.log(1 / 3), math.log(2 / 3)]]), atol=1e-6)
    want = math.log(3) - 2 / 3 * math.log(2)
    assert torch.allclose(entropy, torch.tensor([[want, want]]), atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 2])
def test_a_minus_inf_logit_leaves_the_entropy_finite(top_k: int) -> None:
    # a model may put -inf on tokens it never emits; with or without truncation that token has
    # p = 0 and adds nothing: logits (0, 0, -inf) have the entropy of a fair coin
    from grpo.scoring.distribution import Decoding

    logits = torch.tensor([[0.0, 0.0, -math.inf]])
    at, targets = torch.tensor([[0]]), torch.tensor([[1]])
    logp, entropy = token_logprobs(logits, at, targets, Decoding(top_k=top_k), with_entropy=True)
    assert torch.allclose(logp, torch.tensor([[math.log(0.5)]]), atol=1e-6)
    assert torch.allclose(entropy, torch.tensor([[math.log(2)]]), atol=1e-6)


@pytest.mark.parametrize(
    "row", [[0.0, math.nan, 0.0], [0.0, math.inf, 0.0], [-math.inf, -math.inf, -math.inf]]
)
def test_a_broken_logit_row_still_shows_in_the_entropy(row: list[float]) -> None:
    # the entropy drops the 0 * -inf terms of removed tokens, and only those: a NaN or +inf the
    # model produced, or a row with no token left, must reach the log, not be summed away
    at, targets = torch.tensor([[0]]), torch.tensor([[0]])
    _, entropy = token_logprobs(torch.tensor([row]), at, targets, 1.0, with_entropy=True)
    assert torch.isnan(entropy).all()


def test_the_entropy_of_large_logits_keeps_float32_precision() -> None:
    # logits around 100: summing p x and subtracting it from lse would cancel two sums near
    # 100 (errors ~3e-4 in float32); per-token lse - x keeps each term small and >= 0
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5000, generator=gen, dtype=torch.float64) * 3 + 100
    want = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    at, targets = torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long)
    _, entropy = token_logprobs(logits.float(), at, targets, 1.0, with_entropy=True)
    assert torch.allclose(entropy[0].double(), want, atol=2e-5, rtol=0)


def test_group_rows_default_to_temperature_one_without_entropy_and_keep_the_longest(model):
    # two one-token completions (padded to 3): logp [2, 1], the longest completion's length
    from grpo.scoring.logprobs import group_rows_logprobs

    prompt = torch.tensor([10, 11, 12])
    completion_ids = torch.tensor([[20, 0, 0], [21, 0, 0]])
    with torch.no_grad():
        logp, entropy = group_rows_logprobs(model, prompt, completion_ids, torch.tensor([1, 1]))
    assert entropy is None
    assert logp.shape == (2, 1)
    for i, token in enumerate([20, 21]):
        expected, _ = _naive(model, [10, 11, 12], [token], 1.0)
        assert torch.allclose(logp[i], expected, atol=1e-5)


def test_a_mixed_batch_packs_one_group_and_gives_the_other_one_row_each(model, monkeypatch):
    # group A (prompt of 5, rows 0 and 2) is packed: one sequence of 5 + 2 + 0 tokens with the
    # [L, L] mask; group B (prompt of 3, rows 1 and 3) is two rows of 3 + 4 tokens, no mask
    monkeypatch.setattr(
        packing.ScoringCost, "packing_pays", lambda self, prompt_len, lens: prompt_len > 3
    )
    calls = []
    original = model.forward

    def spy(*args, **kwargs):
        mask = kwargs.get("attention_mask")
        calls.append((tuple(kwargs["input_ids"].shape), None if mask is None else mask.dim()))
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    a, b = [10, 11, 12, 13, 14], [20, 21, 22]
    batch = _batch([a, b, a, b], [[30, 31, 1], [40, 41, 42, 43], [32], [44, 45]], s=5, t=4)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, *batch)
    assert calls == [((1, 7), 4), ((2, 7), None)]
    with torch.no_grad():
        want, _ = _naive(model, b, [40, 41, 42, 43], 1.0)
    assert torch.allclose(logp[1], want, atol=1e-5)


def test_gpt2_packs_with_its_absolute_positions(model) -> None:
    # GPT-2 embeds integer position ids: a packed completion's positions continue its prompt's
    from grpo.scoring.logprobs import scoring_path

    net = _gpt2(model.config.vocab_size)
    assert scoring_path(net)[0] == "packed"
    batch = _padded_batch()
    mask = batch[3]
    with torch.no_grad():
        packed, _ = completion_logprobs(net, *batch)
        full, _ = full_sequence_logprobs(net, *batch)
    assert torch.allclose(packed[mask], full[mask], atol=1e-5)


def _worked_batch():
    # prompts [5, 6] (left padded to 3) for rows 0 and 2, [7, 8, 9] for row 1; completions of
    # 3, 1 and 2 tokens (right padded to 3)
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6]])
    prompt_mask = prompt_ids > 0
    completion_ids = torch.tensor([[10, 11, 12], [13, 0, 0], [14, 15, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]).bool()
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _worked_pack():
    batch = _worked_batch()
    return pack(*batch), batch[3]


def test_pack_by_hand() -> None:
    packed, completion_mask = _worked_pack()
    # sequence 0: prompt 5 6, row 0 less its last token (10 11), row 2 less its last (14): 5
    # tokens; sequence 1: prompt 7 8 9 and row 1's single token, which predicts nothing: 3
    # tokens, left padded to 5. Positions continue each prompt's.
    assert torch.equal(packed.input_ids, torch.tensor([[5, 6, 10, 11, 14], [0, 0, 7, 8, 9]]))
    assert torch.equal(packed.position_ids, torch.tensor([[0, 1, 2, 3, 2], [0, 0, 0, 1, 2]]))
    assert torch.equal(packed.segment, torch.tensor([[0, 0, 1, 1, 2], [-1, -1, 0, 0, 0]]))
    assert torch.equal(packed.group, torch.tensor([[0, 0, 0, 0, 0], [-1, -1, 1, 1, 1]]))
    # the predicting positions are each sequence's last 5 - 2 + 1 = 4; kept index = 4u + j - 1
    assert packed.keep == 4
    # row 0: 6, 10, 11 predict 10, 11, 12 (kept 0, 1, 2); row 1: 9 predicts 13 (kept 7);
    # row 2: 6 predicts 14 (kept 0, shared with row 0), 14 predicts 15 (kept 3)
    assert packed.at[completion_mask].tolist() == [0, 1, 2, 7, 0, 3]


def test_pack_end_to_end_by_hand() -> None:
    prompt_ids, prompt_mask, completion_ids, completion_mask = _worked_batch()
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask, end_to_end=True)
    # the two sequences of test_pack_by_hand one after the other, no padding
    assert torch.equal(packed.input_ids, torch.tensor([[5, 6, 10, 11, 14, 7, 8, 9]]))
    assert torch.equal(packed.position_ids, torch.tensor([[0, 1, 2, 3, 2, 0, 1, 2]]))
    assert torch.equal(packed.segment, torch.tensor([[0, 0, 1, 1, 2, 0, 0, 0]]))
    assert torch.equal(packed.group, torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]]))
    # the head sees only the predicting positions: 6, 10, 11, 14 and 9
    assert packed.keep.tolist() == [1, 2, 3, 4, 7]
    assert packed.kept == 5
    assert packed.at[completion_mask].tolist() == [0, 1, 2, 4, 0, 3]
    # a token sees earlier tokens of its segment and its own group's prompt, never the other's
    allowed = packed.attention_mask(torch.bool)[0, 0]
    assert allowed[5:, :5].sum() == 0 and allowed[:5, 5:].sum() == 0
    assert allowed[4, :2].all() and not allowed[4, 2:4].any()  # 14 sees its prompt, not 10 11


def test_the_shared_start_leaves_every_prompt_a_token_of_its_own() -> None:
    shared = packing._shared_start
    t = torch.tensor
    assert shared([t([5, 6, 7, 8]), t([5, 6, 9]), t([5, 6, 7, 10])]) == 2
    assert shared([t([5, 6, 7]), t([5, 6, 7, 8])]) == 2  # not all of the shorter one
    assert shared([t([5, 6]), t([7, 6])]) == 0
    assert shared([t([5]), t([5, 6])]) == 0
    assert shared([t([5, 6, 7])]) == 0  # one prompt: nothing to share


def test_the_shared_start_ends_where_any_prompt_first_differs() -> None:
    # the start is shared up to the first position where some prompt differs: [5, 9] and
    # [5, 6] share one token; and a prompt that differs at its first token shares none, even
    # where the others agree further on
    shared = packing._shared_start
    t = torch.tensor
    assert shared([t([5, 9, 7, 1]), t([5, 6, 7, 2])]) == 1
    assert shared([t([5, 6, 7, 1]), t([5, 6, 7, 2]), t([9, 6, 7, 3])]) == 0
    # end to end, every group's prompt reads back whole: the shared start, then its own tokens
    prompts = [[5, 6, 7, 1], [5, 6, 7, 2], [9, 6, 7, 3]]
    prompt_ids, completion_ids = torch.tensor(prompts), torch.tensor([[11, 12], [13, 14], [15, 16]])
    packed = pack(prompt_ids, prompt_ids != 0, completion_ids, completion_ids != 0, end_to_end=True)
    ids, group, segment = packed.input_ids[0], packed.group[0], packed.segment[0]
    read = [ids[((group == u) | (group == SHARED)) & (segment == 0)].tolist() for u in range(3)]
    assert sorted(read) == sorted(prompts)
    assert packed.input_ids.shape == (1, 3 * 4 + 3)  # nothing shared: each prompt, each body


def test_packed_attention_mask_by_hand() -> None:
    packed, _ = _worked_pack()
    # a token sees earlier tokens of its own segment and the whole prompt; padding sees padding
    allowed = torch.tensor(
        [
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]],
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        ]
    ).bool()[:, None]
    assert torch.equal(packed.attention_mask(torch.bool), allowed)
    # eager attention adds it in the model's dtype: 0 where attended, the most negative elsewhere
    additive = packed.attention_mask(torch.float16)
    assert additive.dtype == torch.float16
    assert torch.equal(additive, torch.zeros(2, 1, 5, 5).masked_fill(~allowed, -65504.0).half())
