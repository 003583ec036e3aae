"""Choosing each decode step's token: the seeded per-group sampler, the chooser that applies the
decoding controls before it, and transformers' extra logits processors
(``rollout.generation_kwargs``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from grpo.config import ConfigError
from grpo.scoring.distribution import Decoding, process_logits, token_set


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
        decoding: Decoding,
        sampler: SeededGroupSampler,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        extra: LogitsProcessorList,
        greedy: bool = False,
    ) -> None:
        self.sampler, self.extra, self.greedy = sampler, extra, greedy
        # greedy: only what can change the most likely token (the penalty) is applied; the
        # temperature and the truncations keep it, so their [b, V] passes are skipped
        self.decoding = (
            Decoding(repetition_penalty=decoding.repetition_penalty) if greedy else decoding
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
        if self.decoding.repetition_penalty != 1.0 and self.seen is None:
            self.seen = token_set(self.prompt_ids, self.prompt_mask, scores.shape[1])
        seen = None if self.seen is None else self.seen[rows]
        processed = process_logits(scores.float(), self.decoding, seen)  # [b, V]
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
