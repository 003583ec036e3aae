"""Each speed lever on its own: the fast path against the plain one, timed alternately.

    .venv/bin/python -m benchmarks.speed.levers --setup smollm2 --repeats 3

One real rollout of the set-up (P prompts x G completions from the model) is the workload.
Variants of one lever run A B A B ... in this process, so a machine shared with other jobs
slows both alike; the JSON has every timing, the medians and their ratio (fast / plain).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from benchmarks import common
from grpo.config import ModelConfig, RolloutConfig, TrainConfig
from grpo.data import load_dataset_rows, system_prompt_for
from grpo.models import load_policy, load_tokenizer, resolve_model_path
from grpo.rollout import decode, decoding_of, hf, kv_cache, render_prompt
from grpo.rollout.hf import HFEngine, sample_groups
from grpo.rollout.packed_weights import packed_linears
from grpo.rollout.sampler import Chooser, SeededGroupSampler, processor_choice
from grpo.runtime.host_memory import set_malloc_policy
from grpo.scoring import chunked_head, head_products, prefix_attention
from grpo.scoring.distribution import Decoding, process_logits
from grpo.scoring.logprobs import completion_logprobs, full_sequence_logprobs
from grpo.scoring.packing import pack
from grpo.scoring.prefix_attention import PREFIX
from grpo.step_data import Rollout
from grpo.training.micro_batches import micro_batches

RESULTS = Path(__file__).resolve().parents[1] / "results"


def alternate(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Any]:
    """Run the variants in turn ``repeats`` times, in reverse order every other turn (ABBA, so
    that running first or second in a turn favours neither); medians, the ratio of the last's
    median to the first's, and the median of the ratios within each turn
    (``median_pair_ratio``: the two ran moments apart, so a slow spell of a shared host slows
    both; steadier than the ratio of medians where the spells last longer than a turn)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for turn in range(repeats):
        for name in names if turn % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    medians = {name: common.median(ts) for name, ts in times.items()}
    first, last = names[0], names[-1]
    pairs = zip(times[first], times[last], strict=True)
    return {
        "times_s": times,
        "median_s": medians,
        "ratio": common.ratio(medians[last], medians[first]),
        "median_pair_ratio": common.median([b / a for a, b in pairs]),
    }


class GumbelSampler(LogitsProcessor):
    """The sampler ``SeededGroupSampler`` replaced: seeded Gumbel-max, one noise value per
    vocabulary entry per row per token (``argmax`` after it is a sample, as after the new one)."""

    def __init__(self, seeds: list[int], group_size: int) -> None:
        self.group_size = group_size
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]

    def __call__(self, input_ids: Any, scores: torch.Tensor) -> torch.Tensor:
        shape = (self.group_size, scores.shape[-1])
        noise = torch.cat([torch.rand(shape, generator=g) for g in self.generators])
        return scores + -torch.log(-torch.log(noise.clamp(min=1e-20)))


def engine_chooser(
    engine: HFEngine, ids: torch.Tensor, mask: torch.Tensor, g: int, extra: list | None = None
) -> Chooser:
    """The engine's chooser for ``ids`` / ``mask`` [P, S], G rows each, seeded 0 .. P-1."""
    rows_ids, rows_mask = (x.repeat_interleave(g, dim=0) for x in (ids, mask))
    sampler = SeededGroupSampler(list(range(ids.shape[0])), g, engine.model.device)
    processors = LogitsProcessorList(extra or [])
    return Chooser(decoding_of(engine.config), sampler, rows_ids, rows_mask, processors)


def concatenating_cache() -> contextlib.AbstractContextManager:
    """``sample_groups`` on transformers' own KV cache, which copies itself at every token."""
    return mock.patch.object(
        hf, "reserved_cache", lambda model, _: DynamicCache(config=model.config)
    )


def rollout_levers(model, tokenizer, enc, engine: HFEngine, g: int, repeats: int) -> dict:
    """One prefill per prompt against generate() on P*G copies; inference mode; the inverse-CDF
    sampler against Gumbel-max; linear layers on weights packed once (``packed_linears``, bf16
    only) against the weights as they are; the KV cache reserved for the rollout against
    transformers' concatenating one; the engine's chooser, which processes the running
    rows and keeps the drawn token's log-prob only, against a logits processor over every row
    whose output is an argmax (what ``sample_groups`` ran before)."""
    seeds = list(range(enc.input_ids.shape[0]))
    t = engine.config.max_new_tokens

    def processors(sampler: type = SeededGroupSampler) -> LogitsProcessorList:
        args = (seeds, g, model.device) if sampler is SeededGroupSampler else (seeds, g)
        decoding = decoding_of(engine.config)
        return LogitsProcessorList([lambda _, x: process_logits(x, decoding), sampler(*args)])

    @torch.no_grad()
    def plain() -> None:
        model.generate(
            input_ids=enc.input_ids.repeat_interleave(g, dim=0),
            attention_mask=enc.attention_mask.repeat_interleave(g, dim=0),
            generation_config=GenerationConfig(
                do_sample=False,
                max_new_tokens=t,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=engine.eos,
            ),
            logits_processor=processors(),
        )

    def shared(
        mode: Callable[[], Any] = torch.no_grad,
        sampler: type = SeededGroupSampler,
        packed: bool = False,
        choice: str = "processors",
        concatenated_cache: bool = False,
    ) -> Callable[[], None]:
        n = enc.input_ids.shape[0] * g

        def chooser() -> Chooser:
            return engine_chooser(engine, enc.input_ids, enc.attention_mask, g)

        choices = {
            "processors": lambda: processor_choice(processors(sampler), n),
            # the chooser as a processor over every row, the argmax of its output the token
            "chooser_every_row": lambda: processor_choice(chooser(), n),
            "chooser": lambda: chooser().pick,
        }

        def run() -> None:
            with contextlib.ExitStack() as stack:
                stack.enter_context(mode())
                if packed:
                    stack.enter_context(packed_linears(model))
                if concatenated_cache:
                    stack.enter_context(concatenating_cache())
                sample_groups(
                    model,
                    enc.input_ids,
                    enc.attention_mask,
                    g,
                    choices[choice](),
                    t,
                    engine.eos,
                    tokenizer.pad_token_id,
                )

        return run

    return {
        "prefill_once": alternate({"generate": plain, "prefill_once": shared()}, repeats),
        "inference_mode": alternate(
            {"no_grad": shared(), "inference_mode": shared(torch.inference_mode)}, repeats
        ),
        "inverse_cdf_sampler": alternate(
            {"gumbel": shared(sampler=GumbelSampler), "inverse_cdf": shared()}, repeats
        ),
        "packed_weights": alternate({"as_is": shared(), "packed": shared(packed=True)}, repeats),
        "reserved_kv_cache": alternate(
            {
                "concatenated": shared(choice="chooser", concatenated_cache=True),
                "reserved": shared(choice="chooser"),
            },
            repeats,
        ),
        "running_rows_choice": alternate(
            {
                "every_row": shared(choice="chooser_every_row"),
                "running_rows": shared(choice="chooser"),
            },
            repeats,
        ),
    }


def plain_against_fast(
    engine: HFEngine,
    prompts: list[str],
    rows: list[dict],
    g: int,
    repeats: int,
    plain: Callable[[], contextlib.AbstractContextManager],
    names: tuple[str, str],
) -> tuple[dict[str, Any], Rollout, Rollout]:
    """Whole rollouts from the same seeds, alternated: inside ``plain()`` (the path a lever
    replaces, named ``names[0]``) and without it (``names[1]``); the timings and both last
    rollouts."""
    seeds = list(range(len(prompts)))
    rollouts: dict[str, Rollout] = {}

    def run(name: str, context: Callable[[], contextlib.AbstractContextManager]) -> Callable:
        def go() -> None:
            with context():
                rollouts[name] = engine.generate(prompts, rows, g, seeds=seeds)

        return go

    slow, fast = names
    runs = {slow: run(slow, plain), fast: run(fast, contextlib.nullcontext)}
    return alternate(runs, repeats), rollouts[slow], rollouts[fast]


def decode_lever(engine: HFEngine, prompts: list[str], rows: list[dict], g: int, repeats: int):
    """Whole rollouts decoding through the lean step (``rollout/decode.py``) against the
    model's own forward, from the same seeds: the same tokens either way (checked here)."""
    if not decode.leanable(engine.model):
        raise SystemExit(f"--decode: {type(engine.model).__name__} has no lean decode step")
    result, own, lean = plain_against_fast(
        engine,
        prompts,
        rows,
        g,
        repeats,
        lambda: mock.patch.object(decode, "leanable", lambda m: False),
        ("own_forward", "lean"),
    )
    result["same_tokens"] = torch.equal(own.completion_ids, lean.completion_ids)
    result["generated_tokens"] = int(lean.completion_mask.sum())
    return {"lean_decode": result}


def kv_dtype_lever(engine: HFEngine, prompts: list[str], rows: list[dict], g: int, repeats: int):
    """Whole rollouts with the KV cache in the dtype attention multiplies in (bf16 under
    autocast: ``kv_cache.attended_dtype``) against the keys as the rotary embedding gives them
    (float32), from the same seeds: the same tokens and log-probs either way (checked here)."""
    if kv_cache.attended_dtype(engine.model) is None:
        raise SystemExit(
            "--kv-dtype: attention multiplies in the keys' own dtype here (no autocast)"
        )
    result, wide, narrow = plain_against_fast(
        engine,
        prompts,
        rows,
        g,
        repeats,
        lambda: mock.patch.object(kv_cache, "attended_dtype", lambda m: None),
        ("as_they_come", "attended"),
    )
    result["same_tokens"] = torch.equal(wide.completion_ids, narrow.completion_ids)
    result["same_logps"] = torch.equal(wide.sampler_logp, narrow.sampler_logp)
    result["generated_tokens"] = int(narrow.completion_mask.sum())
    length = max(len(engine.tokenizer(p).input_ids) for p in prompts)
    length += engine.config.max_new_tokens // 2
    result["attention_alone"] = {
        "positions": length,
        **decode_attention(engine.model, len(prompts) * g, length, repeats),
    }
    return {"kv_cache_dtype": result}


@torch.no_grad()
def decode_attention(model, rows: int, length: int, repeats: int) -> dict:
    """One decode step's attention over every layer (the model's own attention function, a
    query per row against ``length`` cached positions, the prompt padding masked), on float32
    keys against bf16 ones, as the rollout runs it under autocast: the rest of the step aside."""
    model, _ = decode.unwrapped(model)  # a LoRA policy's
    config, device = model.config, model.device
    modeling = sys.modules[type(model).__module__]
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(
        config._attn_implementation, modeling.eager_attention_forward
    )
    layers = [layer.self_attn for layer in model.model.layers]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = layers[0].head_dim
    q = torch.randn(rows, heads, 1, dim, device=device)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device)
    mask[: rows // 4, ..., : length // 4] = False  # rows with shorter prompts
    keys = [torch.randn(rows, kv_heads, length, dim, device=device) for _ in layers]
    values = [torch.randn(rows, kv_heads, length, dim, device=device).bfloat16() for _ in layers]

    def run(keys: list[torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            for attn, k, v in zip(layers, keys, values, strict=True):
                attend(attn, q, k, v, mask, scaling=attn.scaling)

        return go

    narrow = [k.bfloat16() for k in keys]
    return alternate({"float32_keys": run(keys), "bf16_keys": run(narrow)}, 5 * repeats)


def long_cache_lever(model, enc, engine: HFEngine, g: int, tokens: int, repeats: int) -> dict:
    """The reserved KV cache against transformers' concatenating one on long completions: the
    set-up's first prompt, G rows, EOS banned so every row runs ``tokens`` tokens (the cache
    copy per token grows with the length; the weights streamed per token do not)."""
    ids, mask = enc.input_ids[:1], enc.attention_mask[:1]
    no_eos = torch.tensor(engine.eos)

    def ban_eos(_: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill_(1, no_eos, -math.inf)

    def run(concatenated: bool) -> Callable[[], None]:
        def go() -> None:
            chooser = engine_chooser(engine, ids, mask, g, [ban_eos])
            cache = concatenating_cache() if concatenated else contextlib.nullcontext()
            with torch.no_grad(), cache:
                out = sample_groups(
                    model,
                    ids,
                    mask,
                    g,
                    chooser.pick,
                    tokens,
                    engine.eos,
                    engine.tokenizer.pad_token_id,
                )
            assert int(out.lengths.min()) == tokens

        return go

    result = alternate({"concatenated": run(True), "reserved": run(False)}, repeats)
    return {"long_reserved_kv_cache": {"rows": g, "tokens": tokens, **result}}


def scoring(model, batches: list, logprobs: Callable[..., Any], grad: bool) -> Callable[[], None]:
    """A timed workload: ``logprobs`` over every micro-batch, with backward when ``grad``."""

    def go() -> None:
        for mb in batches:
            with torch.set_grad_enabled(grad):
                logp, _ = logprobs(
                    model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask
                )
                if grad:
                    (logp * mb.completion_mask).sum().backward()
        model.zero_grad(set_to_none=True)

    return go


def logprob_levers(model, rollout, micro_batch_size: int, repeats: int) -> dict:
    """Forward (reference) and forward + backward (update) over the step's micro-batches: one
    full sequence per row against rows packed by prompt (``packing.pack``)."""
    batches = micro_batches(rollout, torch.zeros(rollout.num_completions), micro_batch_size)

    def run(logprobs: Callable[..., Any], grad: bool) -> Callable[[], None]:
        return scoring(model, batches, logprobs, grad)

    model.train()
    full, packed = full_sequence_logprobs, completion_logprobs
    return {
        "reference_forward_packed": alternate(
            {"full": run(full, False), "packed": run(packed, False)}, repeats
        ),
        "update_packed": alternate({"full": run(full, True), "packed": run(packed, True)}, repeats),
        "positions": {
            "full": sum(mb.prompt_ids.numel() + mb.completion_ids.numel() for mb in batches),
            "packed": sum(
                pack(
                    mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask
                ).input_ids.numel()
                for mb in batches
            ),
            "real": int(rollout.prompt_mask.sum() + rollout.completion_mask.sum()),
        },
    }


def attention_lever(model, rollout, micro_batch_size: int, repeats: int) -> dict:
    """Packed scoring with SDPA over the dense [L, L] mask against prefix attention (each
    completion reads its prompt and its own tokens: ``grpo.scoring.prefix_attention``), forward and
    forward + backward; the same packed positions either way."""
    batches = micro_batches(rollout, torch.zeros(rollout.num_completions), micro_batch_size)

    def run(implementation: str, grad: bool) -> Callable[[], None]:
        def scored(*args: Any) -> Any:
            model.config._attn_implementation = implementation
            return completion_logprobs(*args)

        return scoring(model, batches, scored, grad)

    model.train()
    return {
        "reference_forward_prefix": alternate(
            {"mask": run("sdpa", False), "prefix": run(PREFIX, False)}, repeats
        ),
        "update_prefix": alternate(
            {"mask": run("sdpa", True), "prefix": run(PREFIX, True)}, repeats
        ),
    }


def patched_scoring(
    model, rollout, micro_batch_size: int, repeats: int, attribute: str, ways: dict[str, Any]
) -> dict[str, Any]:
    """The step's scoring over its micro-batches under prefix attention (``run_levers`` switches
    the model to it, as training's ``load_policy`` does), forward (``reference_forward``) and forward +
    backward (``update``), alternated with ``prefix_attention.<attribute>`` set to each of
    ``ways`` while the forward runs. Each way's calls are counted (``calls``): a way the
    scoring never called would time the same code twice, and stops the lever."""
    if model.config._attn_implementation != PREFIX:
        raise SystemExit(f"levers: {type(model).__name__} does not score under prefix attention")
    batches = micro_batches(rollout, torch.zeros(rollout.num_completions), micro_batch_size)
    calls = dict.fromkeys(ways, 0)

    def counted(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return ways[name](*args, **kwargs)

        return call

    def run(name: str, grad: bool) -> Callable[[], None]:
        def scored(*args: Any) -> Any:
            with mock.patch.object(prefix_attention, attribute, counted(name)):
                return completion_logprobs(*args)

        return scoring(model, batches, scored, grad)

    model.train()
    timed = {
        phase: alternate({name: run(name, grad) for name in ways}, repeats)
        for phase, grad in (("reference_forward", False), ("update", True))
    }
    if not all(calls.values()):
        raise RuntimeError(f"levers: the scoring never called prefix_attention.{attribute}")
    return {**timed, "calls": calls}


def attention_float32_lever(model, rollout, micro_batch_size: int, repeats: int) -> dict:
    """Prefix attention under bf16 autocast on a CPU: SDPA in bf16 (the queries' dtype) against
    float32 (``prefix_attention.in_float32``, what grpo does), forward and forward + backward
    over the step's micro-batches."""
    ways = {"bf16": lambda q: False, "float32": prefix_attention.in_float32}
    timed = patched_scoring(model, rollout, micro_batch_size, repeats, "in_float32", ways)
    calls = timed.pop("calls")
    return {**{f"{phase}_attention_float32": r for phase, r in timed.items()}, "calls": calls}


def selected_write_back() -> Callable[..., torch.Tensor]:
    """``prefix_attention.write_back`` as it was before: the real slots taken by boolean
    selection (whose backward accumulates through a sort), then copied to their positions.
    The selection's masks and the positions' order are built once per layout, as
    ``prefix_layout`` built them then (every layer of a forward shares its layout); the function
    returned holds those of the last layout it saw."""
    last: dict[str, Any] = {}

    def masks(lay: prefix_attention.PrefixLayout, prompts: torch.Tensor, rows: torch.Tensor):
        if last.get("layout") is not lay:
            split = prompts.shape[0] * prompts.shape[1]
            zero_row = split + rows.shape[0] * rows.shape[1]
            target = (lay.source < zero_row).nonzero().flatten()
            slots = lay.source[target]
            real = torch.zeros(zero_row, dtype=torch.bool, device=lay.source.device)
            real[slots] = True
            select = (real[:split].view(prompts.shape[:2]), real[split:].view(rows.shape[:2]))
            last.update(layout=lay, masks=(target[slots.argsort()], *select))  # slot order
        return last["masks"]

    def write_back(
        prompts: torch.Tensor, rows: torch.Tensor, lay: prefix_attention.PrefixLayout
    ) -> torch.Tensor:
        target, prompt_slots, row_slots = masks(lay, prompts, rows)
        picked = torch.cat([prompts[prompt_slots], rows[row_slots]])
        out = picked.new_zeros(lay.source.shape[0], *picked.shape[1:])
        return out.index_copy(0, target, picked)

    return write_back


def write_back_lever(model, rollout, micro_batch_size: int, repeats: int) -> dict:
    """Prefix attention's write-back of its outputs to the packed positions: by index
    (``prefix_attention.write_back``) against the boolean selection it replaced
    (``selected_write_back``), forward and forward + backward over the step's micro-batches,
    and one layer's attention alone."""
    ways = {"selected": selected_write_back(), "indexed": prefix_attention.write_back}
    timed = patched_scoring(model, rollout, micro_batch_size, repeats, "write_back", ways)
    calls = timed.pop("calls")
    batch = micro_batches(rollout, torch.zeros(rollout.num_completions), micro_batch_size)[0]
    return {
        **{f"{phase}_write_back": result for phase, result in timed.items()},
        "calls": calls,
        "attention_alone": prefix_attention_alone(model, batch, ways, 5 * repeats),
    }


def prefix_attention_alone(
    model, mb: Any, ways: dict[str, Callable[..., torch.Tensor]], repeats: int
) -> dict[str, Any]:
    """One layer's prefix attention, forward and backward, at the packed shapes of micro-batch
    ``mb`` on random queries, keys and values, with each of ``ways`` as its write-back."""
    packed = pack(mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask, True)
    lay = prefix_attention.prefix_layout(packed.segment, packed.group)
    config, (u, length) = model.config, packed.segment.shape
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
    # float32, as the model hands them over under bf16 autocast too (the rotary embedding's
    # float32 cos and sin promote the bf16 projections), and as attention returns them
    qkv = [torch.randn(u, h, length, d) for h in heads]

    def run(way: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            q, k, v = (t.clone().requires_grad_() for t in qkv)
            with mock.patch.object(prefix_attention, "write_back", way):
                out, _ = prefix_attention.prefix_attention_forward(
                    None, q, k, v, None, scaling=d**-0.5, prefix_layout=lay
                )
            out.sum().backward()

        return go

    return alternate({name: run(way) for name, way in ways.items()}, repeats)


def head_lever(model, rollout, micro_batch_size: int, repeats: int) -> dict:
    """Full logits kept for backward (``model.chunked_head: false`` under plain sampling)
    against the model's own head; the LM head a chunk at a time (``model.chunked_head``)
    against full logits, forward and forward + backward, at chunks of 64 to 512 rows, with
    the embedding lookup's gradient sparse or dense, and under plain sampling in place or
    through autograd; and the head's weight gradient over 1024 positions, 64 at a time: ``head_products.add_product_`` (what the
    chunked head does: products in the run's dtype a block of rows at a time, no [V, H]
    temporary) against float32 ``addmm_`` of the chunk's values (what it did at 432d0f6) and a
    whole product in the run's dtype, cast and added (what it did before that)."""
    batches = micro_batches(rollout, torch.zeros(rollout.num_completions), micro_batch_size)
    vocab = model.get_output_embeddings().weight.shape[0]

    def run(
        chunked: bool,
        grad: bool,
        lookup: bool = True,
        rows: int | None = None,
        in_place: bool = True,
        kept: bool = True,
    ) -> Callable[[], None]:
        def scored(*args: Any) -> Any:
            chunked_head.full_logits(model, on=not chunked)
            with contextlib.ExitStack() as patches:
                if not kept:  # full logits from the model's own head, as before they were kept
                    patches.enter_context(
                        mock.patch.object(chunked_head, "head_slot", lambda m: None)
                    )
                if rows is not None:  # chunks of this many positions, on either path
                    patches.enter_context(mock.patch.object(chunked_head, "CHUNK", rows))
                    size = mock.patch.object(chunked_head, "PLAIN_CHUNK_BYTES", rows * 4 * vocab)
                    patches.enter_context(size)
                if not in_place:  # plain sampling through autograd, as before 74cd9ad
                    autograd = mock.patch.object(Decoding, "plain", property(lambda s: False))
                    patches.enter_context(autograd)
                if not lookup:  # the dense lookup gradient, as before lookup_into_grad
                    no_lookup = mock.patch.object(
                        chunked_head, "lookup_into_grad", lambda m: contextlib.nullcontext()
                    )
                    patches.enter_context(no_lookup)
                return completion_logprobs(*args)

        return scoring(model, batches, scored, grad)

    head = model.get_output_embeddings().weight
    run_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else head.dtype
    hidden = torch.randn(1024, head.shape[1]).to(run_dtype)
    grad = (torch.randn(1024, head.shape[0]) * 1e-3).to(run_dtype)
    acc = torch.zeros_like(head, dtype=torch.float32)

    products: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        # what it replaced first, what it is last: the ratio is blocks / float32_addmm
        "float32_addmm": lambda g, h: acc.addmm_(g.T.float(), h.float()),
        "product_per_chunk": lambda g, h: acc.add_((g.T @ h).float()),
        "blocks": lambda g, h: head_products.add_product_(acc, g.T, h),
    }

    def accumulate(product: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[], None]:
        def go() -> None:
            for g, h in zip(grad.split(64), hidden.split(64), strict=True):
                product(g, h)

        return go

    model.train()
    result = {
        "reference_forward_kept_logits": alternate(
            {"own_head": run(False, False, kept=False), "kept": run(False, False)}, repeats
        ),
        "update_kept_logits": alternate(
            {"own_head": run(False, True, kept=False), "kept": run(False, True)}, repeats
        ),
        "reference_forward_chunked_head": alternate(
            {"full_logits": run(False, False), "chunked": run(True, False)}, repeats
        ),
        "update_chunked_head": alternate(
            {"full_logits": run(False, True), "chunked": run(True, True)}, repeats
        ),
        "reference_forward_plain_in_place": alternate(
            {"autograd": run(True, False, in_place=False), "in_place": run(True, False)}, repeats
        ),
        "update_plain_in_place": alternate(
            {"autograd": run(True, True, in_place=False), "in_place": run(True, True)}, repeats
        ),
        "update_chunk_rows": alternate(
            {str(rows): run(True, True, rows=rows) for rows in (64, 128, 256, 512)}, repeats
        ),
        "update_sparse_lookup": alternate(
            {"dense": run(True, True, lookup=False), "sparse": run(True, True)}, repeats
        ),
        "head_weight_gradient": alternate(
            {name: accumulate(product) for name, product in products.items()}, repeats
        ),
    }
    chunked_head.full_logits(model, on=False)
    return result


def optimizer_lever(model, repeats: int) -> dict:
    """One AdamW step over every parameter: the foreach implementation against the fused one."""
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {
        impl: torch.optim.AdamW(model.parameters(), lr=1e-9, **{impl: True})
        for impl in ("foreach", "fused")
    }
    result = alternate({impl: opt.step for impl, opt in optimizers.items()}, repeats)
    model.zero_grad(set_to_none=True)
    return result


def compile_lever(engine: HFEngine, prompts: list[str], rows: list[dict], g: int) -> dict:
    """A rollout eager, then two with ``torch.compile(model.forward, dynamic=True)``: the first
    pays the compilation, the second shows what compiled decoding gives. Through the engine,
    so under bf16 its linear layers run packed (``packed_linears``) in all three."""
    seeds = list(range(len(prompts)))
    times = {}
    for name in ("eager", "compiled_first", "compiled_second"):
        if name == "compiled_first":
            engine.model.forward = torch.compile(engine.model.forward, dynamic=True)
        t0 = time.perf_counter()
        engine.generate(prompts, rows, g, seeds=seeds)
        times[name] = time.perf_counter() - t0
    del engine.model.forward  # back to the class's eager forward
    return {"times_s": times, "ratio": common.ratio(times["compiled_second"], times["eager"])}


def compile_update_lever(model, rollout, micro_batch_size: int, repeats: int) -> dict:
    """Forward + backward of the step's scoring with every decoder layer compiled
    (``nn.Module.compile(dynamic=True)``: one graph serves all layers and every packed length)
    against eager, under prefix attention as training scores. The first compiled pass, which
    pays the compilation, is timed apart. ``capture_dynamic_output_shape_ops`` lets any
    data-dependent shape into the graph (a layer would otherwise break in two there)."""
    import torch._dynamo

    batches = micro_batches(rollout, torch.zeros(rollout.num_completions), micro_batch_size)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    work = scoring(model, batches, completion_logprobs, True)

    def eager() -> None:
        for layer in layers:
            layer._compiled_call_impl = None
        work()

    def compiled() -> None:
        for layer in layers:
            layer.compile(dynamic=True)
        work()

    model.train()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        start = time.perf_counter()
        compiled()
        first = time.perf_counter() - start
        result = alternate({"eager": eager, "compiled": compiled}, repeats)
    for layer in layers:
        layer._compiled_call_impl = None
    return {"update_compiled_layers": {**result, "first_compiled_s": first}}


def threads_lever(fn: Callable[[], Any], repeats: int) -> dict:
    """The same work with 1 thread and with torch's default."""
    default = torch.get_num_threads()

    def with_threads(n: int) -> Callable[[], None]:
        def go() -> None:
            torch.set_num_threads(n)
            try:
                fn()
            finally:
                torch.set_num_threads(default)

        return go

    return alternate(
        {f"threads={default}": with_threads(default), "threads=1": with_threads(1)}, repeats
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(common.SETUPS), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--compile", action="store_true", help="only the torch.compile lever (minutes to compile)"
    )
    parser.add_argument(
        "--compile-update",
        action="store_true",
        help="only the update's decoder layers compiled against eager (a minute to compile)",
    )
    parser.add_argument("--attention", action="store_true", help="only the prefix attention lever")
    parser.add_argument(
        "--attention-float32",
        action="store_true",
        help="only prefix attention in float32 against bf16 (under bf16 autocast)",
    )
    parser.add_argument(
        "--write-back",
        action="store_true",
        help="only prefix attention's write-back by index against boolean selection",
    )
    parser.add_argument("--head", action="store_true", help="only the chunked LM head's levers")
    parser.add_argument("--rollout", action="store_true", help="only the rollout's levers")
    parser.add_argument("--decode", action="store_true", help="only the lean decode step")
    parser.add_argument(
        "--kv-dtype",
        action="store_true",
        help="only the rollout's KV cache in attention's dtype against float32 keys (bf16)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="the model as model.lora.enabled builds the policy (PEFT's LoRA wrapper)",
    )
    parser.add_argument(
        "--long-cache",
        type=int,
        default=0,
        metavar="TOKENS",
        help="only the reserved KV cache, on G rows of TOKENS tokens each (EOS banned)",
    )
    parser.add_argument(
        "--precision", choices=["float32", "bfloat16"], help="default: the set-up's"
    )
    args = parser.parse_args(argv)
    setup = common.with_precision(common.SETUPS[args.setup], args.precision)
    # bf16 autocast over float32 weights, as grpo's model.precision=bf16_autocast runs every forward
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup["precision"] == "bfloat16"):
        run_levers(args, setup)


def run_levers(args: argparse.Namespace, setup: dict[str, Any]) -> None:
    torch.manual_seed(0)
    set_malloc_policy(TrainConfig().malloc)  # freed memory handled as the trainer's default
    path = resolve_model_path(setup["model"])
    tokenizer = load_tokenizer(path)
    # the policy as training loads it: packed scoring under prefix attention (generation and
    # unpacked rows stay SDPA's), dropout off, LoRA's wrapper where asked
    model = load_policy(ModelConfig(lora={"enabled": args.lora}), path)
    config = RolloutConfig(
        prompts_per_step=setup["prompts_per_step"],
        group_size=setup["group_size"],
        max_new_tokens=setup["max_new_tokens"],
    )
    from grpo.config import DataConfig

    data = DataConfig(**setup["data"])
    rows = load_dataset_rows(data, 0)[: config.prompts_per_step]
    prompts = [render_prompt(tokenizer, r["prompt"], system_prompt_for(data)) for r in rows]
    engine = HFEngine(model, tokenizer, config)
    rollout = engine.generate(prompts, rows, config.group_size)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    g = config.group_size
    result: dict[str, Any] = {
        "machine": common.machine(),
        "setup": args.setup,
        "prompt_tokens": int(enc.attention_mask.sum()) // config.prompts_per_step,
        "completion_tokens_mean": float(rollout.completion_mask.sum(dim=1).float().mean()),
        "threads": torch.get_num_threads(),
        "precision": setup["precision"],
        "lora": args.lora,
    }
    mb = setup["micro_batch_size"]
    # the levers run alone on request, each into its own file
    alone = {
        "attention": lambda: attention_lever(model, rollout, mb, args.repeats),
        "attention_float32": lambda: attention_float32_lever(model, rollout, mb, args.repeats),
        "write_back": lambda: write_back_lever(model, rollout, mb, args.repeats),
        "head": lambda: head_lever(model, rollout, mb, args.repeats),
        "rollout": lambda: rollout_levers(model, tokenizer, enc, engine, g, args.repeats),
        "compile": lambda: {"compile_rollout": compile_lever(engine, prompts, rows, g)},
        "compile_update": lambda: compile_update_lever(model, rollout, mb, args.repeats),
        "decode": lambda: decode_lever(engine, prompts, rows, g, args.repeats),
        "kv_dtype": lambda: kv_dtype_lever(engine, prompts, rows, g, args.repeats),
        "long_cache": lambda: long_cache_lever(
            model, enc, engine, g, args.long_cache, args.repeats
        ),
    }
    for name, lever in alone.items():
        if getattr(args, name):
            result.update(lever())
            lora = "_lora" if args.lora else ""
            out = args.out or RESULTS / f"levers_{name}_{args.setup}{lora}.json"
            out.write_text(json.dumps(result, indent=1) + "\n")
            print(json.dumps(result, indent=1))
            return
    result.update(rollout_levers(model, tokenizer, enc, engine, g, args.repeats))
    result.update(logprob_levers(model, rollout, mb, args.repeats))
    result["adamw_fused"] = optimizer_lever(model, args.repeats)
    result["threads_update"] = threads_lever(
        lambda: logprob_levers(model, rollout, mb, 1), args.repeats
    )
    out = args.out or RESULTS / f"levers_{args.setup}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for key, value in result.items():
        if isinstance(value, dict) and "ratio" in value:
            print(f"{key:36s} {value['median_s']}  ratio {value['ratio']:.2f}")
        else:
            print(f"{key:36s} {value}")


if __name__ == "__main__":
    main()
