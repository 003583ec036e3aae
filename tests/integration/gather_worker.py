"""A rank of tests/integration/test_distributed.py's gather test, in a module of its own: a spawned
rank imports this file, and with it torch and grpo's gather alone, not the trainer."""

from __future__ import annotations

import torch


def _scored(groups: int, width: int, g: int = 2, sampler: bool = True):
    from grpo.scoring.distribution import Decoding
    from grpo.step_data import Rollout, Scored
    from grpo.training.gather import empty_rollout

    n = groups * g
    if n == 0:
        rollout = empty_rollout(g)
    else:
        mask = torch.ones(n, width, dtype=torch.bool)
        rollout = Rollout(
            prompt_ids=torch.full((n, width), 7),
            prompt_mask=mask,
            completion_ids=torch.ones(n, 3, dtype=torch.long),
            completion_mask=torch.ones(n, 3, dtype=torch.bool),
            truncated=torch.zeros(n, dtype=torch.bool),
            prompts=["p"] * n,
            completions=[f"c{width}"] * n,
            rows=[{"prompt": "p"}] * groups,
            group_size=g,
            sampler_logp=torch.full((n, 3), -1.0) if sampler else None,
            decoding=Decoding(temperature=0.5),
        )
    rewards = torch.arange(n, dtype=torch.float32)
    return Scored(rollout, rewards[:, None], ["r"], rewards, rewards, {"r": 1})


def gather_worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from grpo.training.gather import gather_scored

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        # a round of 1 prompt over 2 ranks: rank 0 has none (no sampler log-probs either)
        empty_first = gather_scored(_scored(0, 0) if rank == 0 else _scored(1, 3))
        # ranks with prompts of different widths: the narrower is padded on the left
        widths = gather_scored(_scored(1, 2 if rank == 0 else 4, sampler=False))
        if rank == 0:
            torch.save({"empty_first": empty_first, "widths": widths}, out)
    finally:
        dist.destroy_process_group()
