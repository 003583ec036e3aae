"""Typed containers passed between the stages of a step.

``N = P * G`` completions, groups of G contiguous. ``S`` prompt tokens (left padded),
``T`` completion tokens (right padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpo.scoring.distribution import Decoding


@dataclass
class EpisodeRecord:
    """How a multi-turn completion's environment episode went (``grpo.environments``).

    reward: what the episode's ``reward()`` returned (None: no reward, or it failed);
    done: the environment ended the completion; failures: one line for each environment call
    that raised or timed out outside a model's call (start, reward, close, a step that hung);
    time_s: seconds in environment calls; wall_s: its share of the wall time of the rounds of
    environment calls it took part in (a round's split evenly among its calls: summed over a
    batch, the batch's wall time in environment calls); instance: the live object reward functions receive in
    the ``environments`` column (TRL's environment instance; None for none). The instance stays
    in the process that made it: it is left out when the record is pickled.
    """

    reward: Any = None
    done: bool = False
    failures: list[str] = field(default_factory=list)
    time_s: float = 0.0
    wall_s: float = 0.0
    instance: Any = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "instance": None}


@dataclass
class Rollout:
    """What a rollout engine returns.

    prompt_ids: [N, S] left padded; prompt_mask: [N, S] True on real prompt tokens.
    completion_ids: [N, T] right padded; completion_mask: [N, T] True up to and including EOS.
    truncated: [N] True when no EOS was produced within max_new_tokens.
    sampler_logp: [N, T] log-probs the sampler assigned, when the engine reports them.
    decoding: the controls the tokens were sampled under (the trainer scores with the same).
    policy_version: with a producer process (``rollout.max_staleness``), the weights that sampled
        them: optimizer steps applied (None: the weights of the step that trains on them).
    rows: the P dataset rows the prompts came from (one per group).
    sampled_mask: [N, T] multi-turn rollouts only: True on the tokens the policy sampled, False on
        tool outputs and template tokens between turns (in the sequence, never in the loss).
    turns: multi-turn rollouts only: each completion's turns, dicts with the turn's ``text``, its
        tool ``call`` (code or None), the tool's ``output``, ``error`` and ``time_s`` (None when
        no call ran). The last turn's text is the completion's answer.
    episodes: multi-turn rollouts only: each completion's ``EpisodeRecord``.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    prompts: list[str]
    completions: list[str]
    rows: list[dict[str, Any]]
    group_size: int
    sampler_logp: Tensor | None = None
    sampled_mask: Tensor | None = None
    turns: list[list[dict[str, Any]]] | None = None
    decoding: Decoding = field(default_factory=Decoding)
    policy_version: int | None = None
    episodes: list[EpisodeRecord] | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # pickled (a checkpoint's steps made ahead) when the decoding controls were ``sampling``
        if "sampling" in state:
            state = {**state, "decoding": state["sampling"]}
            del state["sampling"]
        self.__dict__.update(state)

    @property
    def num_completions(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def loss_mask(self) -> Tensor:
        """[N, T] True on the tokens the loss counts: the policy's own completion tokens."""
        if self.sampled_mask is None:
            return self.completion_mask
        return self.completion_mask & self.sampled_mask

    @property
    def answers(self) -> list[str]:
        """The text rewards judge: the last turn of a multi-turn completion, else all of it."""
        if self.turns is None:
            return self.completions
        return [turns[-1]["text"] for turns in self.turns]

    def select_groups(self, groups: list[int]) -> Rollout:
        """The rollout restricted to the given group indices (in order)."""
        g = self.group_size
        idx = torch.tensor([i * g + j for i in groups for j in range(g)], dtype=torch.long)
        return Rollout(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            completion_ids=self.completion_ids[idx],
            completion_mask=self.completion_mask[idx],
            truncated=self.truncated[idx],
            prompts=[self.prompts[i] for i in idx.tolist()],
            completions=[self.completions[i] for i in idx.tolist()],
            rows=[self.rows[i] for i in groups],
            group_size=g,
            sampler_logp=None if self.sampler_logp is None else self.sampler_logp[idx],
            sampled_mask=None if self.sampled_mask is None else self.sampled_mask[idx],
            turns=None if self.turns is None else [self.turns[i] for i in idx.tolist()],
            decoding=self.decoding,
            episodes=None if self.episodes is None else [self.episodes[i] for i in idx.tolist()],
        )


@dataclass
class Scored:
    """A rollout with its rewards.

    per_function: [N, K] score of each reward function (NaN where it returned None).
    rewards: [N] weighted sum (None counted as 0). advantages: [N].
    errors: reward function name -> completions that fell back after an error or timeout.
    """

    rollout: Rollout
    per_function: Tensor
    function_names: list[str]
    rewards: Tensor
    advantages: Tensor
    errors: dict[str, int] = field(default_factory=dict)


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """Join rollouts of the same group size, padding prompts on the left, completions on the right."""
    if len(parts) == 1:
        return parts[0]
    s = max(p.prompt_ids.shape[1] for p in parts)
    t = max(p.completion_ids.shape[1] for p in parts)

    def pad(x: Tensor, width: int, left: bool, value: float | int) -> Tensor:
        extra = width - x.shape[1]
        if extra == 0:
            return x
        filler = torch.full((x.shape[0], extra), value, dtype=x.dtype)
        return torch.cat([filler, x] if left else [x, filler], dim=1)

    if len({p.decoding for p in parts}) > 1:
        raise ValueError("rollouts sampled under different controls cannot share a step")
    pad_id = 0
    has_logp = all(p.sampler_logp is not None for p in parts)
    # a rank's empty share of a round has no turns; its (zero) rows count as the policy's own
    multi_turn = any(p.sampled_mask is not None for p in parts)
    return Rollout(
        prompt_ids=torch.cat([pad(p.prompt_ids, s, True, pad_id) for p in parts]),
        prompt_mask=torch.cat([pad(p.prompt_mask, s, True, False) for p in parts]),
        completion_ids=torch.cat([pad(p.completion_ids, t, False, pad_id) for p in parts]),
        completion_mask=torch.cat([pad(p.completion_mask, t, False, False) for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        prompts=[x for p in parts for x in p.prompts],
        completions=[x for p in parts for x in p.completions],
        rows=[x for p in parts for x in p.rows],
        group_size=parts[0].group_size,
        sampler_logp=torch.cat([pad(p.sampler_logp, t, False, 0.0) for p in parts])
        if has_logp
        else None,
        sampled_mask=torch.cat([pad(p.loss_mask, t, False, False) for p in parts])
        if multi_turn
        else None,
        turns=[x for p in parts for x in p.turns or []] if multi_turn else None,
        decoding=parts[0].decoding,
        episodes=[x for p in parts for x in p.episodes or []] if multi_turn else None,
    )
