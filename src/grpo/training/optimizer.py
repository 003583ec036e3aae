"""The optimizer and its schedule: AdamW over the trainable parameters, linear warm-up then
constant or cosine, a clipped step taken only when the gradient is finite and not zero.

bf16 (or float16) trainable weights are stepped through float32 master copies: Adam's update
at a usual learning rate (5e-6) is below half a bf16 ulp for most weights (~0.02: 6e-5), so a
bf16 weight updated in place keeps ~8% of its updates on the tiny test model and forgets the
rest. The optimizer holds the float32 masters; each step casts the gradient to float32 onto
them, steps them and rounds them back into the model's weights. The masters travel in the
checkpoint (``master_state``), so a resume is bit-exact.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import Tensor, nn

from grpo.config import OptimConfig
from grpo.runtime import distributed

LOW_PRECISION = (torch.bfloat16, torch.float16)


def lr_lambda(warmup: int, total: int, schedule: str) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def trainable(policy: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in policy.named_parameters() if p.requires_grad}


def master_copy(weight: nn.Parameter) -> nn.Parameter:
    """What the optimizer steps for ``weight``: itself, or a float32 copy of a bf16 weight."""
    if weight.dtype not in LOW_PRECISION:
        return weight
    return nn.Parameter(weight.detach().float())


def stepped_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def master_weights(
    policy: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, tuple[nn.Parameter, Tensor]]:
    """name -> (the model's bf16 weight, its float32 master in the optimizer); {} in float32.

    The optimizer's parameters are the trainable ones in ``policy.named_parameters()`` order
    (``build_optimizer``), each a master copy or the weight itself."""
    pairs = zip(trainable(policy).items(), stepped_params(optimizer), strict=True)
    return {name: (w, m) for (name, w), m in pairs if m is not w}


def build_optimizer(
    policy: nn.Module, cfg: OptimConfig, total_steps: int, fused: bool
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule over ``total_steps`` optimizer steps, stepping float32 masters of
    bf16 weights (module docstring). ``fused``: no parameter-sized temporaries (0.19x the
    foreach step's time on SmolLM2, docs/performance.md); FSDP2's sharded parameters need the
    default path."""
    optimizer = torch.optim.AdamW(
        [master_copy(w) for w in trainable(policy).values()],
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        fused=fused,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.warmup_steps, total_steps, cfg.schedule)
    )
    return optimizer, scheduler


def master_state(policy: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The float32 masters by parameter name, for a checkpoint ({} in float32)."""
    return {name: m.detach() for name, (_, m) in master_weights(policy, optimizer).items()}


def load_master_state(
    policy: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Tensor] | None
) -> None:
    """Restore the masters after the weights were loaded; a checkpoint without them (written
    before masters existed, or by a float32 run resumed in bf16 by force) starts them from the
    loaded bf16 weights, as a fresh run does."""
    with torch.no_grad():
        for name, (weight, master) in master_weights(policy, optimizer).items():
            master.copy_(state[name] if state else weight)


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


def takes_step(grad_norm: float) -> bool:
    """Whether the optimizer steps: a non-finite gradient would make every weight NaN, and an
    exactly zero one (every group zero-variance at beta 0, or every token masked) has nothing
    to learn, where Adam's momentum and weight decay would still move the weights."""
    return math.isfinite(grad_norm) and grad_norm > 0


def clip_and_step(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR | None,
    max_grad_norm: float | None,
    step: int,
    announce: bool,
    what: str = "the policy",
) -> float:
    """Clip the gradient's global norm, step when ``takes_step`` (the schedule too, as a
    dynamic-sampling step with nothing to learn takes none), free the gradients; returns the
    norm before clipping. Under torchrun the norm is of the all-reduced gradient: every rank
    decides alike. ``scheduler`` None: a constant rate; ``what`` names the model in the
    warning line (the policy, the critic)."""
    masters = master_weights(policy, optimizer)
    for weight, master in masters.values():
        master.grad = None if weight.grad is None else weight.grad.float()
        weight.grad = None
    params = stepped_params(optimizer)
    norm = distributed.as_float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf))
    stepping = takes_step(norm)
    if stepping:
        optimizer.step()
        with torch.no_grad():
            for weight, master in masters.values():
                weight.copy_(master)  # rounded to the nearest bf16
    elif announce and not math.isfinite(norm):
        # the weights stay as they are, as mixed precision's loss scaling skips such a step
        print(
            f"grpo: warning: step {step}: {what}'s gradient norm is {norm} (not finite); "
            f"the optimizer step is skipped, {what}'s weights are unchanged",
            file=sys.stderr,
            flush=True,
        )
    # free the gradients now, not at the next update: the rollout and the frozen log-probs
    # between the two then reuse their memory instead of growing the process (as TRL does)
    optimizer.zero_grad(set_to_none=True)
    if stepping and scheduler is not None:
        scheduler.step()
    return norm
