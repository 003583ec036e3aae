"""Rollouts with Hugging Face models from the policy being trained: the decode loop (each prompt
prefilled once, its KV cache repeated for the group) and the engine around it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo.config import RolloutConfig
from grpo.rollout import decoding_of, grouped_rollout, prompt_seeds
from grpo.rollout.compiled import (
    buffer_pool,
    compilable,
    decode_for,
    graphed,
    graphed_capacity,
    wanted,
)
from grpo.rollout.decode import CACHE_ARG, decode_step
from grpo.rollout.kv_cache import RESERVED_TOKENS, reserved_cache, use_pool
from grpo.rollout.packed_weights import packed_linears, why_float32_unpacked
from grpo.rollout.padding import left_pad
from grpo.rollout.sampler import Choice, Chooser, SeededGroupSampler, extra_processors
from grpo.rollout.stopping import StopStrings, eos_ids
from grpo.rollout.turns import TurnRequest, TurnSample
from grpo.scoring.logprobs import position_ids_from_mask
from grpo.step_data import Rollout


class Decoded(NamedTuple):
    """What ``sample_groups`` returns: tokens [N, T] (pad after a row's end), lengths [N] (tokens
    up to and including the one that ended the row), finished [N] (ended by EOS or a stop string
    rather than by the token limit)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor


def sample_groups(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    group_size: int,
    choose: Choice,
    max_new_tokens: int,
    eos: list[int],
    pad_id: int,
    stop: StopStrings | None = None,
    compile: bool = False,
) -> Decoded:
    """[P, S] left-padded prompts -> [P*G, T] completions (T <= max_new_tokens), groups contiguous.

    Each prompt is prefilled once and its KV cache repeated G times, instead of prefilling G copies
    (what ``generate(num_return_sequences=G)`` does): the prompt costs P, not P*G, forwards. Tokens
    are ``choose(completions so far, scores, rows)`` (``Chooser.pick`` draws them);
    rows that emitted EOS (or a stop string) get ``pad_id`` and leave the batch; the loop stops
    when every row has finished. ``compile``: ``rollout.compile`` (``grpo.rollout.compiled``).
    """
    capacity = input_ids.shape[1] + min(max_new_tokens, RESERVED_TOKENS)
    # a step replayed as a CUDA graph takes fixed shapes: its cache at fixed addresses, every row
    static = graphed(compile, model)
    cache = reserved_cache(model, graphed_capacity(capacity) if static else capacity)
    decode = decode_for(model, compile, lambda: decode_step(model))
    positions = position_ids_from_mask(attention_mask)  # [P, S]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        **{CACHE_ARG: cache},
        use_cache=True,
        logits_to_keep=1,
    )
    if static:  # the group's rows decode in the pool's buffers
        use_pool(cache, buffer_pool(model))
    cache.batch_repeat_interleave(group_size)
    logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)  # [N, V]
    mask = attention_mask.repeat_interleave(group_size, dim=0)  # [N, S + t]
    position = positions[:, -1:].repeat_interleave(group_size, dim=0)  # [N, 1]
    eos_t = torch.tensor(eos, device=input_ids.device)
    n = logits.shape[0]
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=input_ids.device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=input_ids.device)
    finished = torch.zeros(n, dtype=torch.bool, device=input_ids.device)
    rows = torch.arange(n, device=input_ids.device)  # batch row -> completion it extends
    done = torch.zeros(n, dtype=torch.bool, device=input_ids.device)  # per batch row
    for step in range(max_new_tokens):
        nxt = choose(tokens[:, :step], logits, rows).masked_fill(done, pad_id)  # [b]
        tokens[rows, step] = nxt  # [b]
        ended = torch.isin(nxt, eos_t)
        if stop is not None:
            ended |= stop(tokens[rows, : step + 1]).to(ended.device)
        lengths[rows[ended & ~done]] = step + 1
        finished[rows[ended & ~done]] = True
        done |= ended
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if not static and 4 * int(done.sum()) >= len(rows):
            # finished rows leave the batch once they are a quarter of it (each drop copies the cache)
            keep = (~done).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, mask, position, nxt, done = (x[keep] for x in (rows, mask, position, nxt, done))
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        position = position + 1
        logits = decode(nxt, mask, position, cache)
    return Decoded(tokens[:, : int(lengths.max())], lengths, finished)


class HFEngine:
    """Samples G completions per prompt from ``model`` (prompts left padded).

    Reports every sampled token's log-prob under the distribution it was drawn from
    (``Rollout.sampler_logp``), as the vLLM engine does.
    """

    def __init__(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos = eos_ids(tokenizer, model)
        self.extra = extra_processors(model, config.generation_kwargs, self.eos)
        self.stop = StopStrings(tokenizer, config.stop) if config.stop else None
        if config.pack_float32 and (why := why_float32_unpacked(model)):
            print(f"rollout.pack_float32: nothing is packed ({why})", file=sys.stderr, flush=True)
        if config.compile and not compilable(model):
            print(
                f"rollout.compile: {type(model).__name__} decodes eagerly (the compiled step "
                "mirrors Llama, Mistral, Qwen2 and Qwen3 without adapters, hooks or sliding "
                "windows)",
                file=sys.stderr,
                flush=True,
            )

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to do: this engine samples from the policy object itself."""

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The policy in eval mode (no dropout) with its linear layers packed, then as it was.
        Every sampling call runs in one; a caller that samples several times from unchanged
        weights (the turns of a tool rollout, evaluation's batches) holds one around them all,
        so the weights are packed once (a call inside finds them packed)."""
        was_training = self.model.training
        self.model.eval()
        # a compiled step multiplies on its own copy of the weights: packing them too is waste
        compiled = wanted(self.config.compile, self.model)
        try:
            with (
                contextlib.nullcontext()
                if compiled
                else packed_linears(self.model, float32=self.config.pack_float32)
            ):
                yield
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int] | None = None,
        temperature: float | None = None,
        greedy: bool = False,
    ) -> Rollout:
        seeds = prompt_seeds(seeds, len(prompts))
        decoding = decoding_of(self.config, temperature)
        enc = self.tokenizer(
            prompts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        device = self.model.device  # rollouts come back on the CPU, as from vLLM
        ids, attention = enc.input_ids.to(device), enc.attention_mask.to(device)
        chooser = Chooser(
            decoding,
            SeededGroupSampler(seeds, group_size, device),
            ids.repeat_interleave(group_size, dim=0),
            attention.repeat_interleave(group_size, dim=0),
            self.extra,
            greedy,
        )
        with self.session():
            # each prompt's G completions, groups contiguous (the chooser supplies the randomness)
            out = sample_groups(
                self.model,
                ids,
                attention,
                group_size,
                chooser.pick,
                self.config.max_new_tokens,
                self.eos,
                self.tokenizer.pad_token_id,
                self.stop,
                self.config.compile,
            )
        t = out.tokens.shape[1]
        mask = torch.arange(t, device=device) < out.lengths[:, None]  # [N, T]
        return grouped_rollout(
            self.tokenizer,
            enc.input_ids,
            enc.attention_mask,
            out.tokens.cpu(),
            mask.cpu(),
            ~out.finished.cpu(),
            prompts,
            rows,
            group_size,
            torch.stack(chooser.logps, dim=1)[:, :t].cpu() if chooser.logps else None,
            decoding,
        )

    @torch.no_grad()
    def generate_turns(
        self,
        requests: list[TurnRequest],
        stop: list[str],
        greedy: bool = False,
        temperature: float | None = None,
    ) -> list[list[TurnSample]]:
        """One turn for each request (see ``grpo.rollout.turns``); requests share one ``n``.

        Contexts are left padded into one batch; each request's n samples come from its own seed,
        under the same controls as ``generate``. A turn ends at EOS, at the token that completes
        one of ``stop`` (or ``rollout.stop``), or at the request's ``max_tokens``. ``greedy``
        takes the most likely token (no log-probs reported).
        """
        n = requests[0].n
        if any(r.n != n for r in requests):
            raise ValueError("generate_turns: every request of a call must ask for the same n")
        device = self.model.device
        ids, mask = left_pad([r.context for r in requests], self.tokenizer.pad_token_id)
        ids, mask = ids.to(device), mask.long().to(device)  # the mask as the tokenizer gives it
        chooser = Chooser(
            decoding_of(self.config, temperature),
            SeededGroupSampler([r.seed for r in requests], n, device),
            ids.repeat_interleave(n, dim=0),
            mask.repeat_interleave(n, dim=0),
            self.extra,
            greedy,
        )
        strings = [*stop, *self.config.stop]
        with self.session():
            out = sample_groups(
                self.model,
                ids,
                mask,
                n,
                chooser.pick,
                max(r.max_tokens for r in requests),
                self.eos,
                self.tokenizer.pad_token_id,
                StopStrings(self.tokenizer, strings) if strings else None,
                self.config.compile,
            )
        tokens, lengths = out.tokens.cpu(), out.lengths.tolist()
        logps = torch.stack(chooser.logps, dim=1).cpu() if chooser.logps else None  # [N, t]
        samples = []
        for row in range(tokens.shape[0]):
            k = min(lengths[row], requests[row // n].max_tokens)
            samples.append(
                TurnSample(
                    tokens[row, :k].tolist(), None if logps is None else logps[row, :k].tolist()
                )
            )
        return [samples[i * n : (i + 1) * n] for i in range(len(requests))]
