"""Rollouts with Hugging Face ``generate`` from the policy being trained."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import (
    DynamicCache,
    DynamicLayer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
)

from grpo.config import ConfigError, RolloutConfig
from grpo.containers import Rollout
from grpo.rollout import grouped_rollout, sampling_of
from grpo.rollout.decode import CACHE_ARG, decode_step
from grpo.rollout.packed_weights import packed_linears, why_float32_unpacked
from grpo.rollout.turns import TurnRequest, TurnSample
from grpo.scoring.distribution import Sampling, process_logits, token_set
from grpo.scoring.logprobs import position_ids_from_mask


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted({*ids, tokenizer.eos_token_id} - {None})


class SeededGroupSampler(LogitsProcessor):
    """Samples each group's next tokens from its own seeded generator (inverse CDF).

    Each row draws one uniform number u from its group's generator and takes the first token whose
    cumulative probability exceeds u: a draw from ``softmax(scores)`` (tokens at -inf never win).
    The processor returns scores that are 0 at the drawn token and -inf elsewhere, so running
    ``generate`` greedily after it samples exactly as ``do_sample`` would, but the randomness of
    group i comes only from ``seeds[i]``: a prompt's completions do not depend on which other
    prompts share the batch (or the rank), which keeps multi-process runs equal to one process.
    One number per row per token, where Gumbel-max needs a noise value per vocabulary entry.
    scores: [P*G, V], groups contiguous.
    """

    def __init__(self, seeds: list[int], group_size: int, device: torch.device) -> None:
        self.group_size = group_size
        self.device = device
        self.generators = [torch.Generator(device).manual_seed(s) for s in seeds]

    def draw(self, scores: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[b, V] scores of the batch rows ``rows`` [b] (default: all N) -> [b, 1] the drawn token
        of each. Every group's generator advances for all its rows at every call, so what a row
        draws does not depend on which rows are still running."""
        u = torch.cat(
            [
                torch.rand(self.group_size, 1, generator=g, device=self.device)
                for g in self.generators
            ]
        )  # [N, 1] uniform in [0, 1)
        if rows is not None:
            u = u[rows]
        cdf = torch.softmax(scores.float(), dim=-1).cumsum_(dim=-1)  # [b, V]
        # scaled by the total so float rounding in the sum can never push u past the last token
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [b, 1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return torch.full_like(scores, -math.inf).scatter_(-1, self.draw(scores), 0.0)


Choice = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""One decode step's choice: (every row's completion so far [N, t], the running rows' raw
scores [b, V], which rows they are [b]) -> [b] their next tokens. ``b`` shrinks as rows finish
(``sample_groups``)."""


def processor_choice(
    processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n: int
) -> Choice:
    """A transformers-style logits processor over all ``n`` rows (the token is the argmax of
    what it returns) as a ``Choice``: rows that left the batch get zero scores, as in
    ``generate``'s batch, which keeps every row. Slower than ``Chooser``; for comparisons."""

    def choose(input_ids: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        every = scores.new_zeros(n, scores.shape[1]).index_copy_(0, rows, scores)
        return processor(input_ids, every).argmax(dim=-1)[rows]

    return choose


class Chooser(LogitsProcessor):
    """One decode step of the engine: raw scores -> the drawn token (``pick``).

    ``extra`` (transformers' processors from ``rollout.generation_kwargs``) runs on the raw
    logits, then ``grpo.scoring.distribution`` (penalty, temperature, min-p, top-k, top-p), then
    the seeded draw, or with ``greedy`` the most likely token of that distribution (the penalty
    and the extra processors change which one it is; vLLM's greedy decoding applies them too).
    The log-prob of every drawn token under the distribution it was drawn from is kept
    (``logps``, one [N] tensor per step, 0 for rows that had finished), as vLLM reports it.
    ``seen`` [N, V] tracks the prompt's and the completion's tokens for the repetition penalty
    (prompt padding excluded).
    """

    def __init__(
        self,
        sampling: Sampling,
        sampler: SeededGroupSampler,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        extra: LogitsProcessorList,
        greedy: bool = False,
    ) -> None:
        self.sampler, self.extra, self.greedy = sampler, extra, greedy
        # greedy: only what can change the most likely token (the penalty) is applied; the
        # temperature and the truncations keep it, so their [b, V] passes are skipped
        self.sampling = (
            Sampling(repetition_penalty=sampling.repetition_penalty) if greedy else sampling
        )
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask  # [N, S]
        self.seen: torch.Tensor | None = None  # built at the first step, when V is known
        self.logps: list[torch.Tensor] = []

    def pick(
        self, input_ids: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """A ``Choice``: input_ids [N, t] every row's completion so far, scores [b, V] the raw
        logits of the running rows ``rows`` [b] -> [b] their drawn tokens. Only the running rows
        are processed: each [b, V] pass is a stream through memory, and a step makes several."""
        if self.extra:
            scores = self.extra(torch.cat([self.prompt_ids[rows], input_ids[rows]], dim=1), scores)
        if self.sampling.repetition_penalty != 1.0 and self.seen is None:
            self.seen = token_set(self.prompt_ids, self.prompt_mask, scores.shape[1])
        seen = None if self.seen is None else self.seen[rows]
        processed = process_logits(scores.float(), self.sampling, seen)  # [b, V]
        if self.greedy:  # no draw, and no log-prob: nothing was sampled
            picked = processed.argmax(dim=-1, keepdim=True)
            if self.seen is not None:
                self.seen[rows, picked[:, 0]] = True
            return picked[:, 0]
        picked = self.sampler.draw(processed, rows)  # [b, 1]
        # log_softmax at the drawn token only: no second [b, V] tensor
        logp = processed.gather(1, picked)[:, 0] - torch.logsumexp(processed, dim=-1)
        self.logps.append(logp.new_zeros(len(self.prompt_ids)).index_copy_(0, rows, logp))
        if self.seen is not None:
            self.seen[rows, picked[:, 0]] = True
        return picked[:, 0]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """As a transformers logits processor (every row): 0 at the drawn token, -inf elsewhere."""
        picked = self.pick(input_ids, scores, torch.arange(len(scores), device=scores.device))
        return torch.full_like(scores, -math.inf).scatter_(-1, picked[:, None], 0.0)


class StopStrings:
    """Whether each row's newest token completed one of ``strings`` (checked after every token).

    Only the last few tokens are decoded: a stop string of n characters spans at most n tokens,
    and an occurrence that ended earlier would have stopped the row then.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: list[str]) -> None:
        self.tokenizer, self.strings = tokenizer, strings
        self.window = max(len(s) for s in strings) + 1

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, t] completion tokens so far -> [b] True where a stop string appeared."""
        texts = self.tokenizer.batch_decode(tokens[:, -self.window :])
        return torch.tensor([any(s in text for s in self.strings) for text in texts])


# completion positions a rollout's KV cache holds from the start (beyond: it doubles), so a large
# max_new_tokens that completions rarely reach reserves no memory they do not use
RESERVED_TOKENS = 1024


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a buffer reserved for the whole rollout.

    ``DynamicLayer`` concatenates at every token, copying the layer's whole cache each time, so
    a decode step moves the cache through memory three times (read and write to append, read to
    attend) where attending needs one read: quadratic traffic in the completion's length, and
    the cost of a decode step on a CPU whose memory bandwidth is its limit. Here each token
    writes only itself and attention reads a view of the filled part. Holds ``capacity``
    positions at first; a write past them doubles the buffer (at least), so growing costs a
    copy per doubling, not per token, and the buffer is never more than twice what it holds.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0  # after a reset too
        self._reserve(key_states[:, :, :0], value_states[:, :, :0], self.capacity)

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Fresh buffers of ``capacity`` positions holding ``keys`` and ``values`` at the front.
        Only the filled part is ever copied: the rest is memory the rollout may never write (a
        reservation of 1024 tokens for completions of 20), whose pages stay untouched."""
        self.key_buffer = keys.new_empty(*keys.shape[:2], capacity, keys.shape[-1])
        self.value_buffer = values.new_empty(*values.shape[:2], capacity, values.shape[-1])
        self.key_buffer[:, :, : keys.shape[2]] = keys
        self.value_buffer[:, :, : values.shape[2]] = values
        self.length = keys.shape[2]
        self._view()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        held = self.key_buffer.shape[-2]
        if end > held:
            self._reserve(self.keys, self.values, max(end, 2 * held))
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def _view(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # checks the argument, as DynamicLayer's callers expect
        if self.is_initialized:
            self.length = self.keys.shape[-2]
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            rows = torch.arange(self.keys.shape[0], device=self.keys.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            held = self.key_buffer.shape[-2]
            self._reserve(self.keys[indices], self.values[indices], held)


def reserved_cache(model: nn.Module, capacity: int) -> DynamicCache:
    """The model's ``DynamicCache`` with each full-attention layer reserving ``capacity``
    positions; sliding-window and other special layers keep their own behaviour."""
    cache = DynamicCache(config=model.config)
    cache.layers = [
        ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache


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
) -> Decoded:
    """[P, S] left-padded prompts -> [P*G, T] completions (T <= max_new_tokens), groups contiguous.

    Each prompt is prefilled once and its KV cache repeated G times, instead of prefilling G copies
    (what ``generate(num_return_sequences=G)`` does): the prompt costs P, not P*G, forwards. Tokens
    are ``choose(completions so far, scores, rows)`` (``Chooser.pick`` draws them);
    rows that emitted EOS (or a stop string) get ``pad_id`` and leave the batch; the loop stops
    when every row has finished.
    """
    cache = reserved_cache(model, input_ids.shape[1] + min(max_new_tokens, RESERVED_TOKENS))
    decode = decode_step(model)
    positions = position_ids_from_mask(attention_mask)  # [P, S]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        **{CACHE_ARG: cache},
        use_cache=True,
        logits_to_keep=1,
    )
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
        if 4 * int(done.sum()) >= len(rows):
            # finished rows leave the batch once they are a quarter of it (each drop copies the cache)
            keep = (~done).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, mask, position, nxt, done = (x[keep] for x in (rows, mask, position, nxt, done))
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        position = position + 1
        logits = decode(nxt, mask, position, cache)
    return Decoded(tokens[:, : int(lengths.max())], lengths, finished)


# set through rollout.* fields (or by the engine itself), never through generation_kwargs
OWN_FIELDS = {
    "temperature": "rollout.temperature",
    "top_k": "rollout.top_k",
    "top_p": "rollout.top_p",
    "min_p": "rollout.min_p",
    "repetition_penalty": "rollout.repetition_penalty",
    "stop_strings": "rollout.stop",
    "max_new_tokens": "rollout.max_new_tokens",
    "do_sample": "the engine (it always samples)",
    "num_return_sequences": "rollout.group_size",
}


def extra_processors(
    model: nn.Module, kwargs: dict[str, Any], eos: list[int]
) -> LogitsProcessorList:
    """transformers' logits processors for ``rollout.generation_kwargs`` (GenerationConfig names,
    e.g. ``no_repeat_ngram_size``, ``bad_words_ids``, ``min_new_tokens``)."""
    if not kwargs:
        return LogitsProcessorList()
    defaults = GenerationConfig()
    for key in kwargs:
        if key in OWN_FIELDS:
            raise ConfigError(f"rollout.generation_kwargs.{key}: set {OWN_FIELDS[key]} instead")
        if not hasattr(defaults, key):
            raise ConfigError(
                f"rollout.generation_kwargs.{key}: not a transformers GenerationConfig field"
            )
    config = GenerationConfig(**kwargs, eos_token_id=eos)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
    return model._get_logits_processor(config, device=model.device)


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
        try:
            with packed_linears(self.model, float32=self.config.pack_float32):
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
        if seeds is None:
            seeds = torch.randint(2**62, (len(prompts),)).tolist()
        sampling = sampling_of(self.config, temperature)
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
            sampling,
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
            sampling,
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
        width = max(len(r.context) for r in requests)
        ids = torch.full((len(requests), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(ids.shape, dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.context) :] = torch.tensor(r.context, dtype=torch.long)
            mask[i, width - len(r.context) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        chooser = Chooser(
            sampling_of(self.config, temperature),
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
