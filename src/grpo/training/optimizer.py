"""The optimizer and its schedule: AdamW over the trainable parameters, linear warm-up then
constant or cosine, a clipped and finite step."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from grpo.config import OptimConfig
from grpo.runtime import distributed


def lr_lambda(warmup: int, total: int, schedule: str) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def build_optimizer(
    policy: nn.Module, cfg: OptimConfig, total_steps: int, fused: bool
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule over ``total_steps`` optimizer steps. ``fused``: no
    parameter-sized temporaries (0.19x the foreach step's time on SmolLM2, docs/performance.md);
    FSDP2's sharded parameters need the default path."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.warmup_steps, total_steps, cfg.schedule)
    )
    return optimizer, scheduler


def apply_optim_config(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimConfig
) -> None:
    """The config's optimizer settings over restored ones (the same unless a resume was forced
    with new ones): lr, betas, weight decay; the schedule keeps its position."""
    groups = optimizer.param_groups
    for group in groups:
        group.update(initial_lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler.base_lrs = [cfg.lr] * len(groups)
    for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = cfg.lr * factor(scheduler.last_epoch)


def clip_and_step(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    max_grad_norm: float | None,
    step: int,
    announce: bool,
) -> float:
    """Clip the gradient's global norm, step (only when that norm is finite), free the
    gradients; returns the norm before clipping."""
    params = [p for p in policy.parameters() if p.requires_grad]
    norm = distributed.as_float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf))
    finite = math.isfinite(norm)
    if finite:
        optimizer.step()
    elif announce:
        # an inf or NaN step would make every weight NaN (and the next rollout fail): the
        # weights stay as they are, as mixed precision's loss scaling skips such a step
        print(
            f"grpo: warning: step {step}: the gradient's norm is {norm} (not finite); "
            "the optimizer step is skipped, the weights are unchanged",
            file=sys.stderr,
            flush=True,
        )
    # free the gradients now, not at the next update: the rollout and the frozen log-probs
    # between the two then reuse their memory instead of growing the process (as TRL does)
    optimizer.zero_grad(set_to_none=True)
    if finite:
        scheduler.step()
    return norm
