"""Rollouts with Hugging Face ``generate`` from the policy being trained."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo.batch import Rollout
from grpo.config import RolloutConfig
from grpo.logprobs import position_ids_from_mask
from grpo.rollout import completion_mask_and_truncation, grouped_rollout
from grpo.rollout.turns import TurnRequest, TurnSample


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

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        u = torch.cat(
            [
                torch.rand(self.group_size, 1, generator=g, device=self.device)
                for g in self.generators
            ]
        )  # [N, 1] uniform in [0, 1)
        cdf = torch.softmax(scores.float(), dim=-1).cumsum_(dim=-1)  # [N, V]
        # scaled by the total so float rounding in the sum can never push u past the last token
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [N, 1]
        return torch.full_like(scores, -math.inf).scatter_(-1, picked, 0.0)


def sample_groups(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    group_size: int,
    choose: LogitsProcessorList,
    max_new_tokens: int,
    eos: list[int],
    pad_id: int,
    stop: StopStrings | None = None,
) -> torch.Tensor:
    """[P, S] left-padded prompts -> [P*G, T] completion ids (T <= max_new_tokens), groups contiguous.

    Each prompt is prefilled once and its KV cache repeated G times, instead of prefilling G copies
    (what ``generate(num_return_sequences=G)`` does): the prompt costs P, not P*G, forwards. Tokens
    are ``argmax(choose(scores))`` (the seeded sampler makes that a sample); rows that
    emitted EOS (or completed one of ``stop``'s strings) get ``pad_id`` and leave the batch; the
    loop stops when every row has finished.
    """
    cache = DynamicCache(config=model.config)
    positions = position_ids_from_mask(attention_mask)  # [P, S]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    cache.batch_repeat_interleave(group_size)
    logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)  # [N, V]
    mask = attention_mask.repeat_interleave(group_size, dim=0)  # [N, S + t]
    position = positions[:, -1:].repeat_interleave(group_size, dim=0)  # [N, 1]
    eos_t = torch.tensor(eos, device=input_ids.device)
    n, vocab = logits.shape
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=input_ids.device)
    rows = torch.arange(n, device=input_ids.device)  # batch row -> completion it extends
    done = torch.zeros(n, dtype=torch.bool, device=input_ids.device)  # per batch row
    for step in range(max_new_tokens):
        # the sampler draws noise for all N rows at every step, so what a row samples does not
        # depend on which other rows are still running; the warpers and the sampler read only
        # the scores, so no token history is passed
        scores = (
            logits if len(rows) == n else logits.new_zeros(n, vocab).index_copy_(0, rows, logits)
        )
        nxt = choose(None, scores).argmax(dim=-1)[rows].masked_fill(done, pad_id)  # [b]
        tokens[rows, step] = nxt
        done |= torch.isin(nxt, eos_t)
        if stop is not None:
            done |= stop(tokens[rows, : step + 1], rows, step, done)
        if step == max_new_tokens - 1 or bool(done.all()):
            return tokens[:, : step + 1]
        if 4 * int(done.sum()) >= len(rows):
            # finished rows leave the batch once they are a quarter of it (each drop copies the cache)
            keep = (~done).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, mask, position, nxt, done = (x[keep] for x in (rows, mask, position, nxt, done))
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        position = position + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=position,
            cache=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1].float()
    return tokens


class StopStrings:
    """Ends a row when its newest tokens complete one of ``strings``, and records the length.

    Called by ``sample_groups`` after every token with the active rows' tokens so far; only the
    last few tokens are decoded (a string of k characters spans at most k tokens).
    ``lengths[row]`` is the row's token count up to and including the one that completed a string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: list[str]) -> None:
        self.tokenizer = tokenizer
        self.strings = strings
        self.window = max(len(s) for s in strings) + 1
        self.lengths: dict[int, int] = {}

    def __call__(self, tokens: torch.Tensor, rows: torch.Tensor, step: int, done: torch.Tensor):
        """tokens: [b, step + 1]; rows: [b] completion index; done: [b] -> [b] newly stopped."""
        hit = torch.zeros_like(done)
        for k in (~done).nonzero()[:, 0].tolist():
            tail = self.tokenizer.decode(tokens[k, -self.window :])
            if any(s in tail for s in self.strings):
                hit[k] = True
                self.lengths[int(rows[k])] = step + 1
        return hit


class HFEngine:
    """Samples G completions per prompt from ``model`` (prompts left padded)."""

    def __init__(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos = eos_ids(tokenizer, model)
        # argmax after the seeded sampler = seeded sampling (SeededGroupSampler)
        self.warpers: list[LogitsProcessor] = []
        if config.temperature != 1.0:  # dividing by 1 would still cost a pass over [N, V]
            self.warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            self.warpers.append(TopKLogitsWarper(config.top_k))
        if config.top_p < 1:
            self.warpers.append(TopPLogitsWarper(config.top_p))

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to do: this engine samples from the policy object itself."""

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int] | None = None,
    ) -> Rollout:
        if seeds is None:
            seeds = torch.randint(2**62, (len(prompts),)).tolist()
        sampler = SeededGroupSampler(seeds, group_size, self.model.device)
        enc = self.tokenizer(
            prompts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            # each prompt repeated G times, groups contiguous (greedy generate has no
            # num_return_sequences; the sampler supplies the randomness)
            device = self.model.device  # rollouts come back on the CPU, as from vLLM
            completion_ids = sample_groups(  # [N, T]
                self.model,
                enc.input_ids.to(device),
                enc.attention_mask.to(device),
                group_size,
                LogitsProcessorList([*self.warpers, sampler]),
                self.config.max_new_tokens,
                self.eos,
                self.tokenizer.pad_token_id,
            ).cpu()
        finally:
            self.model.train(was_training)
        mask, truncated = completion_mask_and_truncation(completion_ids, self.eos)
        return grouped_rollout(
            self.tokenizer,
            enc.input_ids,
            enc.attention_mask,
            completion_ids,
            mask,
            truncated,
            prompts,
            rows,
            group_size,
        )

    @torch.no_grad()
    def generate_turns(
        self, requests: list[TurnRequest], stop: list[str], greedy: bool = False
    ) -> list[list[TurnSample]]:
        """One turn for each request (see ``grpo.rollout.turns``); requests share one ``n``.

        Contexts are left padded into one batch; each request's n samples come from its own seed.
        Tokens end at the first EOS, at the token that completes a stop string, or at the
        request's ``max_tokens``. ``greedy`` takes the most likely token instead.
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
        sampler = SeededGroupSampler([r.seed for r in requests], n, device)
        choose = LogitsProcessorList([] if greedy else [*self.warpers, sampler])
        stopper = StopStrings(self.tokenizer, stop) if stop else None
        was_training = self.model.training
        self.model.eval()
        try:
            tokens = sample_groups(
                self.model,
                ids.to(device),
                mask.to(device),
                n,
                choose,
                max(r.max_tokens for r in requests),
                self.eos,
                self.tokenizer.pad_token_id,
                stopper,
            ).cpu()
        finally:
            self.model.train(was_training)
        # tokens through the first EOS (finished rows are padded, and the pad may be the EOS)
        ends = completion_mask_and_truncation(tokens, self.eos)[0].sum(dim=1).tolist()
        if stopper is not None:
            ends = [min(end, stopper.lengths.get(row, end)) for row, end in enumerate(ends)]
        return [
            [
                TurnSample(tokens[row, : min(ends[row], r.max_tokens)].tolist())
                for row in range(i * n, (i + 1) * n)
            ]
            for i, r in enumerate(requests)
        ]
