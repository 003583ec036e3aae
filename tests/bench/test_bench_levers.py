"""Speed levers must not change results: each fast path against the plain one it replaces."""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest
import torch
from tiny_gemma3 import tiny_gemma3
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

from grpo.config import RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout import completion_mask_and_truncation, decoding_of, hf, kv_cache
from grpo.rollout.hf import HFEngine, sample_groups
from grpo.rollout.sampler import Chooser, SeededGroupSampler, processor_choice
from grpo.scoring.distribution import Decoding


@pytest.mark.parametrize("eos_bias", [0.0, 2.0])
def test_prefill_once_samples_what_generate_samples(
    tiny_model_dir, eos_bias: float, monkeypatch
) -> None:
    # the prompt is prefilled once per group and its cache repeated G times, and finished rows
    # leave the batch; with the same seeded sampler, every token must equal what generate() draws
    # from G separate prefills. A bias on EOS makes rows finish at different steps. The cache
    # reserves 3 new tokens past the prompt, so it grows (doubling) on the way to 16
    monkeypatch.setattr(hf, "RESERVED_TOKENS", 3)
    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = HFEngine(model, tok, RolloutConfig(max_new_tokens=16, temperature=0.7, top_k=20))
    enc = tok(["a", "a much longer prompt", "mid prompt"], return_tensors="pt", padding=True)
    g, seeds = 4, [11, 12, 13]

    def bias_eos(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # and no token twice in a row: reads each row's own history, so a processor handed
        # another row's tokens (once rows have left the batch) would draw otherwise
        scores = scores + eos_bias * (torch.arange(scores.shape[1]) == tok.eos_token_id)
        return scores.scatter(1, ids[:, -1:], -math.inf)

    def chooser(extra: LogitsProcessorList) -> Chooser:
        sampler = SeededGroupSampler(seeds, g, model.device)
        ids, mask = (x.repeat_interleave(g, dim=0) for x in (enc.input_ids, enc.attention_mask))
        return Chooser(decoding_of(engine.config), sampler, ids, mask, extra)

    # generate() keeps every row in its batch: its chooser processes all 12 at each step
    every = chooser(LogitsProcessorList())
    running = chooser(LogitsProcessorList([bias_eos]))

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
            logits_processor=LogitsProcessorList([bias_eos, every]),
        )[:, enc.input_ids.shape[1] :]
        fast = sample_groups(
            model,
            enc.input_ids,
            enc.attention_mask,
            g,
            running.pick,
            16,
            engine.eos,
            tok.pad_token_id,
        ).tokens
    mask, _ = completion_mask_and_truncation(plain, engine.eos)
    plain = plain.masked_fill(~mask, tok.pad_token_id)
    assert fast.shape == plain.shape == (12, plain.shape[1])
    assert torch.equal(fast, plain)
    # the same log-prob of each drawn token, whether the chooser saw every row or the running ones
    t = plain.shape[1]
    fast_logp, plain_logp = (torch.stack(c.logps, dim=1)[:, :t] for c in (running, every))
    torch.testing.assert_close(fast_logp[mask], plain_logp[mask], rtol=0, atol=1e-6)
    assert bool((fast_logp[mask] < 0).all())
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
    caches, reserve = [], hf.reserved_cache

    def recorded(model: object, capacity: int) -> object:
        caches.append(reserve(model, capacity))
        return caches[-1]

    # a token limit far past what completions reach reserves no cache for it
    with torch.no_grad(), mock.patch.object(hf, "reserved_cache", recorded):
        choose = processor_choice(eos_on_third, 4)
        out = sample_groups(model, enc.input_ids, enc.attention_mask, 2, choose, 10**6, [eos], 0)
    assert out.tokens.tolist() == [[7, 7, eos]] * 4
    assert out.lengths.tolist() == [3] * 4 and out.finished.all()
    width = enc.input_ids.shape[1] + hf.RESERVED_TOKENS
    assert caches[0].layers[0].key_buffer.shape[2] == width


def test_micro_batch_order_keeps_groups_whole_longest_first() -> None:
    from grpo.training.micro_batches import micro_batch_order

    # 3 groups of 2: packed lengths 10 + (1 + 9) = 20, 4 + (2 + 2) = 8, 10 + (8 + 8) = 26
    prompt = torch.tensor([10, 10, 4, 4, 10, 10])
    completion = torch.tensor([1, 9, 2, 2, 8, 8])
    assert micro_batch_order(prompt, completion, 2).tolist() == [4, 5, 0, 1, 2, 3]


def test_reserved_cache_layer_returns_what_concatenation_returns() -> None:
    from transformers import DynamicLayer

    from grpo.rollout.kv_cache import ReservedLayer

    gen = torch.Generator().manual_seed(0)
    reserved, plain = ReservedLayer(capacity=4), DynamicLayer()

    def update(batch: int, n: int) -> None:
        k, v = (torch.randn(batch, 2, n, 5, generator=gen) for _ in range(2))
        got, want = reserved.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert reserved.get_seq_length() == plain.get_seq_length()

    update(4, 2)  # prefill
    buffer = reserved.key_buffer.data_ptr()
    update(4, 1)
    update(4, 1)  # fills the reservation, written in place: the cache was never copied
    assert reserved.key_buffer.data_ptr() == buffer
    update(4, 2)  # grows past it: doubled, so the next tokens are written in place again
    assert reserved.key_buffer.shape[2] == 8
    buffer = reserved.key_buffer.data_ptr()
    update(4, 1)
    assert reserved.key_buffer.data_ptr() == buffer
    for layer in (reserved, plain):
        layer.batch_select_indices(torch.tensor([3, 1]))
    update(2, 1)
    for layer in (reserved, plain):
        layer.batch_repeat_interleave(3)
    update(6, 1)
    for layer in (reserved, plain):
        layer.crop(-2)
    update(6, 1)
    for layer in (reserved, plain):
        layer.reset()
    update(3, 2)  # a reset layer starts over


def test_reserved_cache_copies_only_what_it_holds() -> None:
    # selecting and repeating rows copy the filled positions, not the whole reservation: the
    # rest may never be written (1024 reserved for 20-token completions), and copying it would
    # touch every page of it
    from torch.utils._python_dispatch import TorchDispatchMode

    from grpo.rollout.kv_cache import ReservedLayer

    class LargestWrite(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "empty" not in func.__name__ and isinstance(out, torch.Tensor):
                self.most = max(self.most, out.numel())
            return out

    layer = ReservedLayer(capacity=100)
    layer.update(torch.randn(4, 2, 3, 5), torch.randn(4, 2, 3, 5))  # 3 of 100 positions held
    for change, rows in (
        (lambda: layer.batch_select_indices(torch.tensor([3, 1])), 2),
        (lambda: layer.batch_repeat_interleave(4), 8),
    ):
        with LargestWrite() as largest:
            change()
        assert largest.most <= rows * 2 * 3 * 5
        assert layer.key_buffer.shape == (rows, 2, 100, 5) and layer.get_seq_length() == 3


def test_a_model_with_sliding_window_layers_samples_what_generate_samples() -> None:
    # Gemma 3's layers alternate a 4-token window with full attention: the full layers' cache is
    # reserved, the windowed layers keep transformers' own (it holds the window only; the mask
    # is what keeps the window, so the tokens would not tell); 12 tokens run past the window
    # and rows finish apart, and every token must equal what generate() draws
    model = tiny_gemma3(window=4, layers=4)
    kinds = [type(layer).__name__ for layer in kv_cache.reserved_cache(model, 8).layers]
    assert kinds == ["DynamicSlidingWindowLayer", "ReservedLayer"] * 2
    ids = torch.randint(1, 63, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    g, eos = 3, 63

    def chooser() -> Chooser:
        rows_ids, rows_mask = (x.repeat_interleave(g, dim=0) for x in (ids, mask))
        sampler = SeededGroupSampler([5, 6], g, torch.device("cpu"))
        return Chooser(Decoding(0.9), sampler, rows_ids, rows_mask, LogitsProcessorList())

    with torch.no_grad():
        plain = model.generate(
            input_ids=ids.repeat_interleave(g, dim=0),
            attention_mask=mask.repeat_interleave(g, dim=0),
            generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=eos
            ),
            logits_processor=LogitsProcessorList([chooser()]),
        )[:, ids.shape[1] :]
        fast = sample_groups(model, ids, mask, g, chooser().pick, 12, [eos], 0).tokens
    done, _ = completion_mask_and_truncation(plain, [eos])
    assert torch.equal(fast, plain.masked_fill(~done, 0)[:, : fast.shape[1]])
    lengths = done.sum(dim=1)
    assert int(lengths.max()) == 12 and int(lengths.min()) < 12  # past the window, rows apart


def test_the_decode_lever_times_both_paths_on_the_same_tokens(tiny_model_dir) -> None:
    from benchmarks.speed.levers import decode_lever

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = HFEngine(model, load_tokenizer(str(tiny_model_dir)), RolloutConfig(max_new_tokens=6))
    result = decode_lever(engine, ["a", "bcd"], [{}, {}], 2, repeats=2)["lean_decode"]
    assert result["same_tokens"] and result["generated_tokens"] > 0
    assert [len(t) for t in result["times_s"].values()] == [2, 2]


def test_the_kv_dtype_lever_times_both_caches_on_the_same_tokens(tiny_model_dir) -> None:
    from benchmarks.speed.levers import kv_dtype_lever

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = HFEngine(model, load_tokenizer(str(tiny_model_dir)), RolloutConfig(max_new_tokens=6))
    with pytest.raises(SystemExit, match="no autocast"):
        kv_dtype_lever(engine, ["a"], [{}], 2, repeats=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = kv_dtype_lever(engine, ["a", "bcd"], [{}, {}], 2, repeats=2)["kv_cache_dtype"]
    assert result["same_tokens"] and result["same_logps"] and result["generated_tokens"] > 0
    assert [len(t) for t in result["times_s"].values()] == [2, 2]
    alone = result["attention_alone"]
    assert alone["positions"] >= 6 and [len(t) for t in alone["times_s"].values()] == [10, 10]


def test_the_decode_lever_runs_on_the_lora_policy(tmp_path) -> None:
    from benchmarks.speed import levers

    out = tmp_path / "lora.json"
    levers.main(["--setup", "tiny", "--decode", "--lora", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["lora"] and result["lean_decode"]["same_tokens"]


@pytest.mark.device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("end_to_end", [False, True])
def test_the_write_back_lever_compares_two_ways_of_the_same_numbers(
    end_to_end: bool, dtype: torch.dtype, device: torch.device
) -> None:
    from benchmarks.speed.levers import selected_write_back
    from grpo.scoring.packing import pack
    from grpo.scoring.prefix_attention import prefix_layout, write_back

    # prompts of 4, 4 and 3 tokens sharing a start; completions of 3, 1, 4, 2 and 2 tokens
    prompt_ids = torch.tensor(
        [[5, 6, 7, 8], [5, 6, 7, 8], [0, 5, 6, 9], [0, 5, 6, 9], [5, 6, 7, 10]]
    )
    completion_ids = torch.tensor(
        [[11, 12, 13, 0], [14, 0, 0, 0], [15, 16, 17, 18], [19, 20, 0, 0], [21, 22, 0, 0]]
    )
    ids = [t.to(device) for t in (prompt_ids, prompt_ids != 0, completion_ids, completion_ids != 0)]
    packed = pack(*ids, end_to_end)
    lay = prefix_layout(packed.segment, packed.group)
    # the attention's outputs in their dtype (bf16 under CUDA autocast) on the device
    make = {"dtype": dtype, "device": device}
    prompts = torch.randn(*lay.prompt_at.shape, 3, 4, **make, requires_grad=True)
    rows = torch.randn(*lay.rows_query.shape, 3, 4, **make, requires_grad=True)
    grad = torch.randn(lay.source.shape[0], 3, 4, **make)
    results = []
    for way in (write_back, selected_write_back()):
        out = way(prompts, rows, lay)
        out.backward(grad)
        results.append((out.detach(), prompts.grad.clone(), rows.grad.clone()))
        prompts.grad, rows.grad = None, None
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    real = packed.segment.flatten() >= 0
    assert (results[0][0][~real] == 0).all() and (results[0][0][real] != 0).all()


def test_alternate_gives_the_ratio_of_medians_and_the_median_ratio_within_turns(
    monkeypatch,
) -> None:
    from benchmarks.speed import levers

    # turns of (a, b) seconds: (1, 2), (4, 2), (2, 1.5): medians 2 and 2 (ratio 1); within
    # the turns b took 2x, 0.5x and 0.75x a's time (median 0.75). The second turn runs b first
    order = []
    clock = iter([0, 1, 1, 3, 3, 5, 5, 9, 9, 11, 11, 12.5])
    monkeypatch.setattr(levers.time, "perf_counter", lambda: next(clock))
    variants = {name: lambda name=name: order.append(name) for name in ("a", "b")}
    result = levers.alternate(variants, repeats=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert result["times_s"] == {"a": [1, 4, 2], "b": [2, 2, 1.5]}
    assert result["ratio"] == 1.0
    assert result["median_pair_ratio"] == 0.75


def test_the_write_back_lever_times_both_ways_in_scoring_and_alone(tmp_path) -> None:
    from benchmarks.speed import levers

    out = tmp_path / "write_back.json"
    levers.main(["--setup", "tiny", "--write-back", "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    for key, turns in [
        ("reference_forward_write_back", 2),
        ("update_write_back", 2),
        ("attention_alone", 10),
    ]:
        times = result[key]["times_s"]
        assert list(times) == ["selected", "indexed"]
        assert [len(t) for t in times.values()] == [turns, turns]
        assert result[key]["median_pair_ratio"] > 0
    # both ways ran inside the scoring (a model left on SDPA would time neither)
    assert result["calls"]["selected"] > 0 and result["calls"]["indexed"] > 0


def test_the_attention_float32_lever_times_both_precisions_of_prefix_attention(tmp_path) -> None:
    from benchmarks.speed import levers

    out = tmp_path / "float32.json"
    argv = ["--setup", "tiny", "--attention-float32", "--precision", "bfloat16"]
    levers.main([*argv, "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    for phase in ("reference_forward", "update"):
        times = result[f"{phase}_attention_float32"]["times_s"]
        assert list(times) == ["bf16", "float32"] and [len(t) for t in times.values()] == [2, 2]
    assert result["calls"]["bf16"] > 0 and result["calls"]["float32"] > 0


def test_a_scoring_lever_refuses_a_model_left_on_sdpa(tiny_model_dir) -> None:
    from benchmarks.speed import levers

    # its patched setting would never be read: the lever would time one path twice
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(SystemExit, match="does not score under prefix attention"):
        levers.patched_scoring(model, None, 8, 1, "write_back", {"a": None, "b": None})
