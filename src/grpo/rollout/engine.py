"""What every engine shares: the engine protocol, the seeds and decoding controls of a call, and
the ``Rollout`` built from sampled ids (masks up to the first EOS, prompts repeated per group,
completions decoded)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from grpo.config import RolloutConfig
from grpo.scoring.distribution import Decoding
from grpo.step_data import Rollout


class RolloutLost(RuntimeError):
    """Generation that runs elsewhere (a producer process, a rollout server) died, failed or
    stopped answering: the run stops with a checkpoint and this one line."""


class RolloutEngine(Protocol):
    def generate(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int] | None = None,
        temperature: float | None = None,
        greedy: bool = False,
    ) -> Rollout: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


def release(part: object) -> None:
    """Release what an engine or an environment holds, where it has a ``close`` (vLLM's engine
    core, which must go before the process group it joined does; an environment's loop)."""
    close = getattr(part, "close", None)
    if callable(close):
        close()


def prompt_seeds(seeds: list[int] | None, prompts: int) -> list[int]:
    """The seeds a caller gave, or one per prompt drawn from torch's global generator (which a
    run seeds with ``train.seed``)."""
    return torch.randint(2**62, (prompts,)).tolist() if seeds is None else seeds


def decoding_of(config: RolloutConfig, temperature: float | None = None) -> Decoding:
    """The decoding controls of ``rollout.*``, at ``temperature`` when given."""
    return Decoding(
        temperature=config.temperature if temperature is None else temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
    )


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]], system: str | None
) -> str:
    """A dataset prompt (string or chat messages) as the text the model continues: the chat
    template when the tokenizer has one, else plain text, the system prompt first (the default
    ``grpo.data.prompts.PromptFormat``; recipes may set a template)."""
    from grpo.data.prompts import PromptFormat

    return PromptFormat(system=system).render(tokenizer, {"prompt": prompt})


def completion_mask_and_truncation(
    completion_ids: Tensor, eos_token_ids: list[int]
) -> tuple[Tensor, Tensor]:
    """[N, T] ids -> (mask [N, T] True up to and including the first EOS, truncated [N])."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids))  # [N, T]
    has_eos = is_eos.any(dim=1)  # [N]
    t = completion_ids.shape[1]
    first_eos = torch.where(
        has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, t, dtype=torch.long)
    )
    positions = torch.arange(t).unsqueeze(0)  # [1, T]
    mask = positions <= first_eos.unsqueeze(1)  # [N, T]
    return mask, ~has_eos


def decode_completions(
    tokenizer: PreTrainedTokenizerBase, completion_ids: Tensor, mask: Tensor
) -> list[str]:
    return [
        tokenizer.decode(ids[m], skip_special_tokens=True)
        for ids, m in zip(completion_ids, mask, strict=True)
    ]


def grouped_rollout(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    truncated: Tensor,
    prompts: list[str],
    rows: list[dict[str, Any]],
    group_size: int,
    sampler_logp: Tensor | None = None,
    decoding: Decoding | None = None,
) -> Rollout:
    """A Rollout from P prompts ([P, S], left padded) and their N = P*G completions ([N, T]).

    Prompts are repeated G times so groups stay contiguous; masked completion positions hold
    the pad id (and sampler log-prob 0), and the text is decoded from the counted tokens.
    """
    completion_ids = completion_ids.masked_fill(~completion_mask, tokenizer.pad_token_id)
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.bool().repeat_interleave(group_size, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        prompts=[p for p in prompts for _ in range(group_size)],
        completions=decode_completions(tokenizer, completion_ids, completion_mask),
        rows=list(rows),
        group_size=group_size,
        sampler_logp=None
        if sampler_logp is None
        else sampler_logp.masked_fill(~completion_mask, 0.0),
        decoding=decoding or Decoding(),
    )
