"""Property tests (hypothesis) for the invariances the math promises, over generated inputs."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.algorithm import LossKnobs, Normalizer, group_advantages, policy_loss

SETTINGS = settings(max_examples=60, deadline=None)
# rewards of any real-world size; groups whose spread is tiny against eps are generated apart
reward = st.floats(-100, 100, allow_nan=False, width=32)


@st.composite
def grouped_rewards(draw, min_spread: float = 0.05) -> tuple[torch.Tensor, int]:
    """[P * G] float32 rewards, every group with a population std of at least min_spread."""
    g = draw(st.integers(2, 8))
    p = draw(st.integers(1, 4))
    groups = []
    for _ in range(p):
        values = draw(st.lists(reward, min_size=g, max_size=g))
        group = torch.tensor(values, dtype=torch.float32)
        if float(group.double().std(unbiased=False)) < min_spread:
            group = group + torch.arange(g, dtype=torch.float32)  # spread of at least 0.5
        groups.append(group)
    return torch.cat(groups), g


@SETTINGS
@given(grouped_rewards(), st.data())
def test_a_shift_of_a_groups_rewards_changes_no_advantage(case, data) -> None:
    rewards, g = case
    shifts = torch.tensor(
        data.draw(st.lists(reward, min_size=len(rewards) // g, max_size=len(rewards) // g))
    )
    shifted = rewards + shifts.repeat_interleave(g)
    for scale in ("group", "none"):  # per-group statistics: each group's own shift cancels
        a, b = group_advantages(rewards, g, scale), group_advantages(shifted, g, scale)
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), scale
    # the batch std is shared by all groups: a shift of the whole batch cancels
    everything = rewards + shifts[0]
    a, b = group_advantages(rewards, g, "batch"), group_advantages(everything, g, "batch")
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)


@SETTINGS
@given(grouped_rewards(), st.floats(0.5, 20))
def test_group_scaling_ignores_a_positive_scale(case, factor: float) -> None:
    rewards, g = case
    for scale in ("group", "batch"):
        a, b = group_advantages(rewards, g, scale), group_advantages(rewards * factor, g, scale)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), scale
    # no scaling (Dr. GRPO) keeps the factor
    a, b = group_advantages(rewards, g, "none"), group_advantages(rewards * factor, g, "none")
    assert torch.allclose(a * factor, b, atol=1e-3, rtol=1e-4)


@SETTINGS
@given(grouped_rewards(min_spread=0.0), st.randoms(use_true_random=False))
def test_permuting_a_group_permutes_its_advantages(case, rng) -> None:
    rewards, g = case
    order = []
    for start in range(0, len(rewards), g):
        block = list(range(start, start + g))
        rng.shuffle(block)
        order += block
    order = torch.tensor(order)
    for scale in ("group", "batch", "none"):
        a = group_advantages(rewards, g, scale)
        b = group_advantages(rewards[order], g, scale)
        assert torch.allclose(b, a[order], atol=1e-5, rtol=1e-5), scale


@SETTINGS
@given(grouped_rewards(min_spread=0.0), st.integers(0, 3), reward)
def test_a_zero_variance_group_is_exactly_zero(case, which: int, value: float) -> None:
    rewards, g = case
    p = len(rewards) // g
    which = which % p
    rewards = rewards.clone()
    rewards[which * g : (which + 1) * g] = value
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, g, scale)
        assert torch.equal(adv[which * g : (which + 1) * g], torch.zeros(g)), scale


@st.composite
def step_batch(draw):
    """A step's log-probs, advantages and mask, and a split of its rows into micro-batches."""
    n = draw(st.integers(2, 8))
    t = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)  # ratios != 1
    ref = logp + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    lengths = draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=n - 1))))
    bounds = [0, *cuts, n]
    order = draw(st.permutations(range(n)))  # micro-batches need not be contiguous rows
    parts = [torch.tensor(order[a:b]) for a, b in itertools.pairwise(bounds)]
    return logp, old, ref, adv, mask, parts


KNOBS = st.fixed_dictionaries(
    {
        "clip_low": st.floats(0.0, 0.5),
        "clip_high": st.floats(0.0, 0.5),
        "beta": st.floats(0.0, 1.0),
        "kl_estimator": st.sampled_from(["k1", "k2", "k3"]),
        "ratio_level": st.sampled_from(["token", "sequence"]),
        "dual_clip": st.one_of(st.none(), st.floats(1.01, 5.0)),
        "cispo_clip_low": st.one_of(st.none(), st.floats(0.0, 1.0)),
        "cispo_clip_high": st.floats(0.01, 5.0),
        "sapo_tau_pos": st.floats(0.1, 10.0),
        "sapo_tau_neg": st.floats(0.1, 10.0),
    }
)


@SETTINGS
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"])
@given(batch=step_batch(), knobs=KNOBS)
def test_micro_batch_splits_give_the_steps_loss_and_gradient(loss_type: str, batch, knobs) -> None:
    logp, old, ref, adv, mask, parts = batch
    if loss_type in ("cispo", "sapo"):
        knobs = {**knobs, "dual_clip": None}  # a knob of the clipped surrogate only
    n = len(adv)
    norm = Normalizer(
        num_sequences=n,
        num_tokens=float(mask.sum()),
        num_micro_batches=len(parts),
        max_new_tokens=7,
    )

    def loss_and_grad(rows_list, normalizer):
        x = logp.clone().requires_grad_(True)
        total = sum(
            policy_loss(
                x[rows],
                old[rows],
                adv[rows],
                mask[rows],
                ref[rows],
                knobs=LossKnobs(loss_type=loss_type, **knobs),
                normalizer=normalizer,
            )[0]
            for rows in rows_list
        )
        total.backward()
        return total.detach(), x.grad

    split_loss, split_grad = loss_and_grad(parts, norm)
    if loss_type == "bnpo":
        # by definition the mean over micro-batches of each one's token mean
        means = [
            loss_and_grad([rows], Normalizer(len(rows), float(mask[rows].sum()), 1, 7))
            for rows in parts
        ]
        whole_loss = sum(m[0] for m in means) / len(parts)
        whole_grad = sum(m[1] for m in means) / len(parts)
    else:
        whole_loss, whole_grad = loss_and_grad([torch.arange(n)], norm)
    assert torch.allclose(split_loss, whole_loss, atol=1e-10, rtol=1e-9)
    assert torch.allclose(split_grad, whole_grad, atol=1e-10, rtol=1e-9)
    assert torch.equal(split_grad[~mask], torch.zeros_like(split_grad[~mask]))
