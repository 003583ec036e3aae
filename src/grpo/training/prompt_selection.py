"""Which prompts a step trains on: dynamic sampling (DAPO) and the pre-rollout filter (GRESO).

A group whose G rewards are all equal has zero advantage everywhere: it costs a rollout and
gives no gradient (it only dilutes the loss's normalisation).

- Dynamic sampling (Yu et al., 2025, DAPO) drops such groups after scoring and rolls out more
  prompts until the step has ``target`` informative groups, for at most ``max_rounds`` rounds.
  The first round draws ``target`` prompts; each later round draws the deficit divided by the
  share of informative groups seen so far in this step (at most ``target``). Extra informative
  groups of the last round are dropped, so every full step trains on exactly ``target`` groups.
  Under torchrun every rank sees every round's groups (gathered), makes the same choices, and
  then takes an equal share of whole kept groups (``rank_groups``); a short step keeps a multiple
  of the number of ranks.
- The pre-rollout filter (Zheng et al., 2025, GRESO, arXiv 2506.02177) keeps each prompt's
  recent history across epochs and, before rolling out, skips with probability ``skip_prob`` a
  prompt whose last ``k`` visits were all zero-variance. The paper adapts the skip probability
  per prompt (``1 - p_e^z`` for ``z`` consecutive zero-variance epochs, with ``p_e`` tuned to a
  target zero-variance rate); here it is one fixed, configurable probability. The draw is a pure
  function of (seed, prompt index, epoch), so a resumed run skips the same prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from grpo.algorithm import zero_std_groups
from grpo.data.stream import Draw
from grpo.step_data import Scored, concat_rollouts

# --------------------------------------------------------------------------------------- GRESO


@dataclass
class PromptFilter:
    """GRESO's per-prompt history: prompt index -> zero-variance flags of its last ``k`` visits."""

    k: int
    skip_prob: float
    seed: int
    history: dict[int, list[bool]] = field(default_factory=dict)

    def eligible(self, index: int) -> bool:
        """True when the prompt's last k visits were all zero-variance."""
        past = self.history.get(index, [])
        return len(past) >= self.k and all(past[-self.k :])

    def draw(self, index: int, epoch: int) -> float:
        """The uniform number deciding a skip: seeded by (seed, prompt, epoch), not by call order."""
        return random.Random(f"greso:{self.seed}:{index}:{epoch}").random()

    def skip(self, index: int, epoch: int) -> bool:
        return self.eligible(index) and self.draw(index, epoch) < self.skip_prob

    def record(self, index: int, zero_variance: bool) -> None:
        self.history[index] = [*self.history.get(index, []), zero_variance][-self.k :]

    def state_dict(self) -> dict[int, list[bool]]:
        return {index: list(flags) for index, flags in self.history.items()}

    def load_state_dict(self, state: dict[int, list[bool]]) -> None:
        self.history = {int(index): list(flags) for index, flags in state.items()}


def draw_prompts(
    next_draw: Callable[[], Draw],
    n: int,
    prompt_filter: PromptFilter | None,
    max_skips: int,
) -> tuple[list[Draw], int]:
    """Take ``n`` prompts from the stream, skipping the ones the filter drops.

    At most ``max_skips`` prompts are skipped per call (then the filter is ignored), so a data
    set where every prompt is filtered cannot stall the step. Returns (draws, skipped).
    """
    draws: list[Draw] = []
    skipped = 0
    while len(draws) < n:
        draw = next_draw()
        skip = prompt_filter is not None and skipped < max_skips
        if skip and prompt_filter.skip(draw.index, draw.epoch):
            skipped += 1
            continue
        draws.append(draw)
    return draws, skipped


# --------------------------------------------------------------------------------------- dynamic


def select_groups(scored: Scored, groups: list[int]) -> Scored:
    """The scored rollout restricted to the given group indices (in order)."""
    g = scored.rollout.group_size
    idx = torch.tensor([i * g + j for i in groups for j in range(g)], dtype=torch.long)
    return replace(
        scored,
        rollout=scored.rollout.select_groups(groups),
        per_function=scored.per_function[idx],
        rewards=scored.rewards[idx],
        advantages=scored.advantages[idx],
    )


def concat_scored(parts: list[Scored]) -> Scored:
    """Join scored rollouts of the same reward functions; error counts add up."""
    if len(parts) == 1:
        return parts[0]
    errors: dict[str, int] = {}
    for part in parts:
        for name, count in part.errors.items():
            errors[name] = errors.get(name, 0) + count
    return Scored(
        rollout=concat_rollouts([p.rollout for p in parts]),
        per_function=torch.cat([p.per_function for p in parts]),
        function_names=parts[0].function_names,
        rewards=torch.cat([p.rewards for p in parts]),
        advantages=torch.cat([p.advantages for p in parts]),
        errors=errors,
    )


def next_round_size(target: int, kept: int, found: int, drawn: int) -> int:
    """Prompts for the next round: the deficit over the informative share seen so far."""
    if found == 0:
        return target
    return min(target, math.ceil((target - kept) * drawn / found))


@dataclass
class Collected:
    """One step's rollouts.

    train: the groups passed to the loss (None when dynamic sampling found none).
    seen: every group rolled out this step, for reward metrics (the kept ones are biased).
    prompts_drawn / prompts_kept: groups rolled out / groups in ``train``; rounds: rollout calls.
    """

    train: Scored | None
    seen: Scored
    prompts_drawn: int
    prompts_kept: int
    rounds: int


def collect(
    sample: Callable[[int], Scored],
    target: int,
    *,
    dynamic: bool,
    max_rounds: int,
    advantages: Callable[[Scored], Tensor],
    multiple_of: int = 1,
) -> Collected:
    """Roll out and score ``target`` prompts; with ``dynamic``, keep only informative groups.

    sample(n) rolls out and scores n prompts. advantages(scored) -> [N] recomputes the
    advantages over the kept batch (they differ from the per-round ones only for statistics
    over the batch: batch scaling, GDPO, REINFORCE++).
    multiple_of: the kept groups are trimmed to a multiple of it (ranks take equal shares).
    """
    if not dynamic:
        scored = sample(target)
        return Collected(scored, scored, target, target, 1)
    seen: list[Scored] = []
    kept: list[Scored] = []
    n_kept = found = drawn = rounds = 0
    while n_kept < target and rounds < max_rounds:
        scored = sample(next_round_size(target, n_kept, found, drawn))
        rounds += 1
        seen.append(scored)
        g = scored.rollout.group_size
        informative = (~zero_std_groups(scored.rewards, g)).nonzero().flatten().tolist()
        drawn += scored.rewards.numel() // g
        found += len(informative)
        take = informative[: target - n_kept]
        if take:
            kept.append(select_groups(scored, take))
            n_kept += len(take)
    train = None
    n_kept -= n_kept % multiple_of
    if n_kept:
        train = select_groups(concat_scored(kept), list(range(n_kept)))
        train = replace(train, advantages=advantages(train))
    return Collected(train, concat_scored(seen), drawn, n_kept, rounds)


def rank_groups(scored: Scored, rank: int, world_size: int) -> Scored:
    """Rank's contiguous, equal share of whole groups (their count divides by world_size)."""
    groups = scored.rewards.numel() // scored.rollout.group_size
    share = groups // world_size
    return select_groups(scored, list(range(rank * share, (rank + 1) * share)))
