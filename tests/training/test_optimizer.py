"""The optimizer and its schedule: warm-up then constant or cosine, the config over a restored
optimizer, a clipped step that is skipped when the gradient is zero or not finite, and bf16
weights trained through float32 master copies."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo.config import ModelConfig, OptimConfig
from grpo.models import load_policy
from grpo.training.optimizer import (
    apply_optim_config,
    build_optimizer,
    clip_and_step,
    load_master_state,
    lr_lambda,
    master_state,
)

LR = 5e-6


def bf16_policy(path: Path) -> nn.Module:
    return load_policy(ModelConfig(name=str(path), dtype="bfloat16"), str(path))


def lm_loss(policy: nn.Module) -> torch.Tensor:
    """A fixed next-token loss whose gradient reaches every weight (tied head: every vocab row)."""
    ids = torch.randint(
        0, policy.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1)
    )
    return policy(ids, labels=ids).loss


def stepped(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def changed_share(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    changed = sum(int((x != y).sum()) for x, y in zip(a, b, strict=True))
    return changed / sum(x.numel() for x in a)


def test_bf16_weights_train_through_float32_masters(tiny_model_dir: Path) -> None:
    policy = bf16_policy(tiny_model_dir)
    weights = [p for p in policy.parameters() if p.requires_grad]
    start = [w.detach().clone() for w in weights]
    optimizer, scheduler = build_optimizer(policy, OptimConfig(lr=LR), 100, fused=True)
    masters = stepped(optimizer)
    lm_loss(policy).backward()
    clip_and_step(policy, optimizer, scheduler, 1.0, 1, announce=False)
    # Adam's first step moves each weight by about lr = 5e-6: a float32 master holds that for
    # every weight, while a bf16 weight of magnitude ~0.02 (half an ulp: 6e-5) keeps only ~8%
    assert changed_share([m.detach() for m in masters], [s.float() for s in start]) > 0.99
    for weight, master in zip(weights, masters, strict=True):
        assert (weight.dtype, master.dtype) == (torch.bfloat16, torch.float32)
        assert torch.equal(weight.detach(), master.detach().bfloat16())
    assert all(w.grad is None for w in weights) and all(m.grad is None for m in masters)
    # the accumulated update shows up in the bf16 weights: measured 0.56 of them after 10 steps
    # and 0.88 after 13 (float32 training, rounded); updating bf16 in place stays at 0.079
    for step in range(2, 14):
        lm_loss(policy).backward()
        clip_and_step(policy, optimizer, scheduler, 1.0, step, announce=False)
    assert changed_share([w.detach() for w in weights], start) > 0.8
    for weight, master in zip(weights, masters, strict=True):
        assert torch.equal(weight.detach(), master.detach().bfloat16())


def test_a_zero_gradient_takes_no_step(tiny_model_dir: Path) -> None:
    policy = bf16_policy(tiny_model_dir)
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2)
    optimizer, scheduler = build_optimizer(policy, cfg, 100, fused=True)
    lm_loss(policy).backward()
    assert clip_and_step(policy, optimizer, scheduler, 1.0, 1, announce=False) > 0
    masters = stepped(optimizer)
    before = [m.detach().clone() for m in masters]
    moments = [optimizer.state[m]["exp_avg"].clone() for m in masters]
    # every completion masked: the loss is 0 times the log-probs, its gradient exactly zero
    (lm_loss(policy) * 0).backward()
    assert clip_and_step(policy, optimizer, scheduler, 1.0, 2, announce=False) == 0.0
    # Adam's momentum and weight decay would have moved every weight; the warm-up (factor
    # (k + 1) / 3 after k steps) stays at 2/3
    assert all(torch.equal(b, m) for b, m in zip(before, masters, strict=True))
    now = [optimizer.state[m]["exp_avg"] for m in masters]
    assert all(torch.equal(a, b) for a, b in zip(moments, now, strict=True))
    assert all(float(optimizer.state[m]["step"]) == 1 for m in masters)
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == 1e-3 * 2 / 3
    assert all(p.grad is None for p in policy.parameters())
    lm_loss(policy).backward()
    clip_and_step(policy, optimizer, scheduler, 1.0, 3, announce=False)
    assert all(float(optimizer.state[m]["step"]) == 2 for m in masters)
    assert sum(not torch.equal(b, m) for b, m in zip(before, masters, strict=True)) == len(masters)


def test_warmup_then_constant() -> None:
    f = lr_lambda(warmup=3, total=10, schedule="constant")
    # warm-up factors (s+1)/(w+1): 0.25, 0.5, 0.75, then 1.0 for good
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_cosine() -> None:
    f = lr_lambda(warmup=2, total=12, schedule="cosine")
    assert f(2) == pytest.approx(1.0)  # cosine starts at the peak
    assert f(7) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))  # half way: 0.5
    assert f(12) == pytest.approx(0.0, abs=1e-12)


def test_cosine_quarter_way_past_the_end_and_without_warmup() -> None:
    f = lr_lambda(warmup=0, total=8, schedule="cosine")
    assert f(0) == 1.0  # no warm-up: the first step is at the peak
    assert f(2) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # 0.8536
    assert f(20) == pytest.approx(0.0, abs=1e-12)  # past the last step it stays at zero
    # a warm-up as long as the run: the cosine has one step (no division by zero)
    g = lr_lambda(warmup=4, total=4, schedule="cosine")
    assert [g(s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 0.0], abs=1e-12)


def _policy() -> nn.Module:
    policy = nn.Sequential(nn.Linear(2, 1, bias=False), nn.Linear(1, 1, bias=False))
    policy[1].weight.requires_grad_(False)  # frozen, as a LoRA base
    return policy


def test_adamw_over_the_trainable_parameters_with_warmup() -> None:
    policy = _policy()
    cfg = OptimConfig(lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1, warmup_steps=3)
    optimizer, scheduler = build_optimizer(policy, cfg, total_steps=10, fused=False)
    (group,) = optimizer.param_groups
    assert [p is policy[0].weight for p in group["params"]] == [True]
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.9), 0.1)
    assert group["lr"] == pytest.approx(0.25e-3)  # the first warm-up factor, 1/4
    optimizer.step()  # no gradients: the weights stay, the schedule moves on
    scheduler.step()
    assert group["lr"] == pytest.approx(0.5e-3)


def test_the_config_replaces_a_restored_optimizers_settings_at_its_position() -> None:
    policy = _policy()
    old = OptimConfig(lr=1e-3, warmup_steps=3)
    optimizer, scheduler = build_optimizer(policy, old, total_steps=10, fused=False)
    for _ in range(2):  # two steps done: the next factor is 3/4
        optimizer.step()
        scheduler.step()
    new = OptimConfig(lr=2e-3, betas=(0.5, 0.6), weight_decay=0.2, warmup_steps=3)
    apply_optim_config(optimizer, scheduler, new)
    (group,) = optimizer.param_groups
    assert group["lr"] == pytest.approx(1.5e-3)  # 2e-3 x 0.75: the schedule keeps its place
    assert (group["initial_lr"], group["betas"], group["weight_decay"]) == (2e-3, (0.5, 0.6), 0.2)
    optimizer.step()
    scheduler.step()
    assert group["lr"] == pytest.approx(2e-3)  # warm-up over, at the new peak


def _sgd_step(grad: list[float], max_grad_norm: float | None, announce: bool = True):
    """One ``clip_and_step`` of plain SGD (lr 1) from weights 0 with the given gradient:
    (the norm it returns, the weights after, the gradient after, the schedule's position)."""
    layer = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(layer.weight)
    layer.weight.grad = torch.tensor([grad])
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    norm = clip_and_step(layer, optimizer, scheduler, max_grad_norm, step=7, announce=announce)
    return norm, layer.weight.detach()[0].tolist(), layer.weight.grad, scheduler.last_epoch


def test_the_step_is_clipped_to_the_global_norm_and_frees_the_gradient() -> None:
    # gradient (3, 4): norm 5, clipped to norm 1 -> (0.6, 0.8); SGD at lr 1 steps by minus that
    norm, weights, grad, position = _sgd_step([3.0, 4.0], max_grad_norm=1.0)
    assert norm == pytest.approx(5.0)  # the norm before clipping
    assert weights == pytest.approx([-0.6, -0.8], abs=1e-6)
    assert grad is None and position == 1
    # no limit: the whole gradient
    norm, weights, _, _ = _sgd_step([3.0, 4.0], max_grad_norm=None)
    assert norm == pytest.approx(5.0) and weights == pytest.approx([-3.0, -4.0])


def test_a_gradient_that_is_not_finite_skips_the_step_and_says_so(capsys) -> None:
    norm, weights, grad, position = _sgd_step([math.inf, 1.0], max_grad_norm=1.0)
    assert math.isinf(norm)
    assert weights == [0.0, 0.0] and grad is None and position == 0  # no step, no schedule
    assert capsys.readouterr().err == (
        "grpo: warning: step 7: the policy's gradient norm is inf (not finite); the optimizer "
        "step is skipped, the policy's weights are unchanged\n"
    )
    norm, weights, _, _ = _sgd_step([math.nan, 1.0], max_grad_norm=1.0, announce=False)
    assert math.isnan(norm) and weights == [0.0, 0.0]
    assert capsys.readouterr().err == ""  # ranks other than 0 stay quiet


def test_a_bf16_weight_without_a_gradient_stays_and_the_others_step() -> None:
    # a trainable bf16 weight that took no part in this step's forward has no gradient: its
    # master gets none either, so AdamW leaves it (no weight decay, no state) and the step
    # goes on for the weights that have one
    policy = nn.Sequential(nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False))
    policy.to(torch.bfloat16)
    start = [w.detach().clone() for w in policy.parameters()]
    cfg = OptimConfig(lr=0.25, weight_decay=0.1)
    optimizer, scheduler = build_optimizer(policy, cfg, 10, fused=False)
    policy[0](torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()  # policy[1] unused
    assert policy[1].weight.grad is None
    norm = clip_and_step(policy, optimizer, scheduler, None, 1, announce=False)
    assert norm == pytest.approx(math.sqrt(2))  # the used weight's gradient (1, 1)
    used, unused = stepped(optimizer)
    # Adam's first step: lr x sign(gradient) = -0.25 each, after decay by 1 - lr x 0.1
    expected = start[0].float() * (1 - 0.25 * 0.1) - 0.25
    assert torch.allclose(used.detach(), expected, atol=1e-6)
    assert torch.equal(policy[0].weight.detach(), used.detach().bfloat16())
    assert torch.equal(policy[1].weight.detach(), start[1]) and optimizer.state[unused] == {}
    assert all(p.grad is None for p in policy.parameters())


def test_the_cosine_schedule_runs_over_the_steps_given_after_the_warmup() -> None:
    policy = _policy()
    cfg = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine")
    optimizer, scheduler = build_optimizer(policy, cfg, total_steps=6, fused=True)
    (group,) = optimizer.param_groups
    assert group["fused"] is True  # asked for: no parameter-sized temporaries
    rates = []
    for _ in range(6):
        rates.append(group["lr"])
        optimizer.step()
        scheduler.step()
    # warm-up 1/3, 2/3; then the cosine over the remaining 4 steps: progress 0, 1/4, 1/2, 3/4
    cosine = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert rates == pytest.approx([1e-3 * f for f in [1 / 3, 2 / 3, *cosine]], rel=1e-9)


def test_a_checkpoint_restores_the_float32_masters_not_the_rounded_weights() -> None:
    def bf16_layer() -> nn.Module:
        layer = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([[0.02, -0.03, 0.05, 0.01]]))
        return layer

    policy = bf16_layer()
    optimizer, _ = build_optimizer(policy, OptimConfig(lr=LR), 10, fused=False)
    policy.weight.grad = torch.ones_like(policy.weight)
    clip_and_step(policy, optimizer, None, None, 1, announce=False)
    saved = master_state(policy, optimizer)["weight"].clone()
    # Adam's 5e-6 is below half a bf16 ulp here: the weights stay, only the masters moved
    assert torch.equal(policy.weight.detach(), bf16_layer().weight.detach())
    assert torch.allclose(saved, policy.weight.detach().float() - LR, rtol=0, atol=1e-8)
    resumed = bf16_layer()  # the checkpoint's bf16 weights, loaded
    optimizer, _ = build_optimizer(resumed, OptimConfig(lr=LR), 10, fused=False)
    load_master_state(resumed, optimizer, {"weight": saved})
    (master,) = stepped(optimizer)
    assert master.dtype == torch.float32 and torch.equal(master.detach(), saved)
    # a checkpoint without masters starts them from the loaded weights, as a fresh run does
    load_master_state(resumed, optimizer, None)
    assert torch.equal(master.detach(), resumed.weight.detach().float())
