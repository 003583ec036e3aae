"""Dynamic sampling and the GRESO pre-rollout filter: scripted units, then the trainer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from grpo.algorithm import zero_std_groups
from grpo.step_data import Rollout, Scored
from grpo.training.producer import Round
from grpo.training.prompt_selection import (
    Draw,
    PromptFilter,
    collect,
    concat_scored,
    draw_prompts,
    next_round_size,
    rank_groups,
    select_groups,
)
from grpo.training.trainer import Trainer

# ----------------------------------------------------------------------------- GRESO filter


def scripted_filter(skip_prob: float) -> PromptFilter:
    # k = 2: eligible are prompts whose last two visits were both zero-variance
    f = PromptFilter(k=2, skip_prob=skip_prob, seed=7)
    history = {
        0: [True, True],  # eligible
        1: [False, True],  # last visit informative before: no
        2: [True],  # one visit only: no
        3: [True, True, True],  # eligible (only the last 2 are kept)
        4: [True, False],  # no
        6: [True, True],  # eligible
        7: [False, True, True],  # eligible
    }  # prompt 5 never visited: no
    for index, flags in history.items():
        for flag in flags:
            f.record(index, flag)
    return f


def stream(epoch: int, n: int = 8):
    draws = iter(Draw(i, epoch, epoch * n + i) for i in range(n))
    return lambda: next(draws)


def test_history_keeps_the_last_k_visits() -> None:
    f = scripted_filter(0.5)
    assert f.history[3] == [True, True] and f.history[7] == [True, True]
    assert [i for i in range(8) if f.eligible(i)] == [0, 3, 6, 7]


@pytest.mark.parametrize(("skip_prob", "expected"), [(1.0, [0, 3, 6, 7]), (0.0, [])])
def test_filter_skips_exactly_the_eligible_prompts(skip_prob: float, expected: list) -> None:
    # 9 prompts: prompt 8 (never visited) comes last, after every eligible one
    f = scripted_filter(skip_prob)
    draws, skipped = draw_prompts(stream(1, 9), 9 - len(expected), f, max_skips=9)
    assert [d.index for d in draws] == [i for i in range(9) if i not in expected]
    assert skipped == len(expected)


def test_filter_with_a_fixed_seed() -> None:
    # pinned draws u = Random("greso:7:<prompt>:<epoch>").random() for the eligible prompts:
    # epoch 1: p0 0.747, p3 0.319, p6 0.430, p7 0.937 -> below 0.5: skip 3 and 6
    # epoch 2: p0 0.452, p3 0.577, p6 0.913, p7 0.542 -> skip 0 only
    f = scripted_filter(0.5)
    draws, skipped = draw_prompts(stream(1), 6, f, max_skips=8)
    assert [d.index for d in draws] == [0, 1, 2, 4, 5, 7] and skipped == 2
    draws, skipped = draw_prompts(stream(2), 7, f, max_skips=8)
    assert [d.index for d in draws] == [1, 2, 3, 4, 5, 6, 7] and skipped == 1
    # the decision depends on (seed, prompt, epoch) only: asking again gives the same answer
    assert [f.skip(i, 1) for i in range(8)] == [f.skip(i, 1) for i in range(8)]


def test_skip_prob_is_the_chance_of_a_skip(monkeypatch) -> None:
    # the draw u is uniform on [0, 1): skipping when u < skip_prob skips with probability
    # skip_prob exactly, so 0 never skips, even on a draw of exactly 0
    f = scripted_filter(0.0)
    monkeypatch.setattr(f, "draw", lambda index, epoch: 0.0)
    assert not any(f.skip(i, 1) for i in range(8))
    f.skip_prob = 0.25
    monkeypatch.setattr(f, "draw", lambda index, epoch: 0.25)
    assert not any(f.skip(i, 1) for i in range(8))
    monkeypatch.setattr(f, "draw", lambda index, epoch: 0.2499)
    assert [i for i in range(8) if f.skip(i, 1)] == [0, 3, 6, 7]


def test_max_skips_bounds_the_filter() -> None:
    f = scripted_filter(1.0)
    draws, skipped = draw_prompts(stream(1), 6, f, max_skips=1)
    # only prompt 0 may be skipped; 3 is then taken although it is eligible
    assert [d.index for d in draws] == [1, 2, 3, 4, 5, 6] and skipped == 1


def test_filter_state_round_trip() -> None:
    f = scripted_filter(0.5)
    g = PromptFilter(k=2, skip_prob=0.5, seed=7)
    g.load_state_dict(f.state_dict())
    assert g.history == f.history


# ----------------------------------------------------------------------------- dynamic sampling

G = 2


def fake_scored(group_rewards: list[tuple[float, float]], tag: str) -> Scored:
    """Groups of G=2 with given rewards; completions are named <tag><group> for tracing."""
    n = len(group_rewards) * G
    rewards = torch.tensor([r for pair in group_rewards for r in pair])
    rollout = Rollout(
        prompt_ids=torch.ones(n, 3, dtype=torch.long),
        prompt_mask=torch.ones(n, 3, dtype=torch.bool),
        completion_ids=torch.ones(n, 2, dtype=torch.long),
        completion_mask=torch.ones(n, 2, dtype=torch.bool),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompts=[f"{tag}{i // G}" for i in range(n)],
        completions=[f"{tag}{i // G}" for i in range(n)],
        rows=[{"prompt": f"{tag}{i}"} for i in range(len(group_rewards))],
        group_size=G,
    )
    return Scored(rollout, rewards.unsqueeze(1), ["r"], rewards, torch.zeros(n), {"r": 1})


class Script:
    """sample(n) returns the next scripted round, checking the size the collector asked for."""

    def __init__(self, rounds: list[tuple[int, list[tuple[float, float]]]]) -> None:
        self.rounds = list(rounds)
        self.asked: list[int] = []

    def __call__(self, n: int) -> Scored:
        expected_n, groups = self.rounds.pop(0)
        self.asked.append(n)
        assert n == expected_n == len(groups)
        return fake_scored(groups, tag=f"r{len(self.asked)}g")


ZERO, INFO = (1.0, 1.0), (1.0, 0.0)


def double(scored: Scored) -> torch.Tensor:
    return 2 * scored.rewards


def test_round_size() -> None:
    # 1 informative of 4 drawn, 3 missing: 3 * 4 / 1 = 12, capped at the target 4
    assert next_round_size(4, kept=1, found=1, drawn=4) == 4
    # 3 of 4 informative, 1 missing: ceil(1 * 4 / 3) = 2
    assert next_round_size(4, kept=3, found=3, drawn=4) == 2
    assert next_round_size(4, kept=0, found=0, drawn=4) == 4


def test_dynamic_sampling_fills_the_batch_with_informative_groups() -> None:
    # round 1: 4 prompts, groups 1 and 3 informative -> 2 kept, share 2/4 -> ask ceil(2*4/2) = 4
    # round 2: groups 0, 2, 3 informative -> take the first two -> 4 kept after 8 drawn
    script = Script([(4, [ZERO, INFO, ZERO, INFO]), (4, [INFO, ZERO, INFO, INFO])])
    out = collect(script, 4, dynamic=True, max_rounds=5, advantages=double)
    assert (out.prompts_drawn, out.prompts_kept, out.rounds) == (8, 4, 2)
    assert out.train.rollout.completions[::G] == ["r1g1", "r1g3", "r2g0", "r2g2"]
    assert not zero_std_groups(out.train.rewards, G).any()
    assert torch.equal(out.train.advantages, 2 * out.train.rewards)  # recomputed on the batch
    assert out.seen.rewards.numel() == 8 * G  # every rolled-out group, for the metrics
    assert out.seen.errors == {"r": 2}  # error counts add up over the rounds


def test_dynamic_sampling_stops_after_max_rounds() -> None:
    script = Script([(2, [ZERO, ZERO]), (2, [ZERO, INFO]), (2, [ZERO, ZERO])])
    out = collect(script, 2, dynamic=True, max_rounds=3, advantages=double)
    # round 2 found 1 of 4 so far -> asks min(2, ceil(1 * 4 / 1)) = 2; round 3 finds nothing
    assert script.asked == [2, 2, 2]
    assert (out.prompts_drawn, out.prompts_kept, out.rounds) == (6, 1, 3)
    assert out.train.rollout.completions == ["r2g1", "r2g1"]


def test_the_informative_share_counts_every_round() -> None:
    # round 1: 2 of 4 informative -> ask ceil(2 * 4 / 2) = 4; round 2: 1 more (3 of 8 so far)
    # -> ask ceil(1 * 8 / 3) = 3, not the last round's share ceil(1 * 8 / 1) = 8 capped at 4
    script = Script([(4, [INFO, INFO, ZERO, ZERO]), (4, [INFO, ZERO, ZERO, ZERO]), (3, [INFO] * 3)])
    out = collect(script, 4, dynamic=True, max_rounds=3, advantages=double)
    assert script.asked == [4, 4, 3]
    assert (out.prompts_drawn, out.prompts_kept, out.rounds) == (11, 4, 3)


def test_a_short_step_keeps_a_multiple_of_the_ranks() -> None:
    # 3 informative groups of 4 after the last round, 2 ranks: 2 kept (each rank trains one);
    # the batch-scaled advantages are recomputed on the 2 kept
    script = Script([(4, [INFO, ZERO, INFO, INFO])])
    out = collect(script, 4, dynamic=True, max_rounds=1, advantages=double, multiple_of=2)
    assert (out.prompts_drawn, out.prompts_kept) == (4, 2)
    assert out.train.rollout.completions[::G] == ["r1g0", "r1g2"]
    shares = [rank_groups(out.train, r, 2).rollout.completions[::G] for r in range(2)]
    assert shares == [["r1g0"], ["r1g2"]]  # whole groups, contiguous, in rank order


def test_dynamic_sampling_can_find_nothing() -> None:
    out = collect(Script([(2, [ZERO, ZERO])]), 2, dynamic=True, max_rounds=1, advantages=double)
    assert out.train is None and (out.prompts_drawn, out.prompts_kept, out.rounds) == (2, 0, 1)


def test_without_dynamic_sampling_every_group_is_kept() -> None:
    out = collect(Script([(2, [ZERO, INFO])]), 2, dynamic=False, max_rounds=4, advantages=double)
    assert out.train is out.seen and (out.prompts_drawn, out.prompts_kept, out.rounds) == (2, 2, 1)


def test_select_and_concat() -> None:
    a = fake_scored([INFO, ZERO, (0.0, 3.0)], "a")
    a = replace(a, advantages=torch.arange(6.0))
    picked = select_groups(a, [2, 0])
    assert picked.rewards.tolist() == [0.0, 3.0, 1.0, 0.0]
    assert picked.advantages.tolist() == [4.0, 5.0, 0.0, 1.0]  # each completion keeps its own
    assert [r["prompt"] for r in picked.rollout.rows] == ["a2", "a0"]
    none = select_groups(a, [])  # no group: an empty batch of the same layout
    assert none.rewards.numel() == none.advantages.numel() == 0
    assert none.per_function.shape == (0, 1) and none.rollout.completions == []
    joined = concat_scored([picked, fake_scored([ZERO], "b")])
    assert joined.rollout.completions == ["a2", "a2", "a0", "a0", "b0", "b0"]
    assert joined.per_function.shape == (6, 1)


# ----------------------------------------------------------------------------- in the trainer

# "+" prompts always score 0 (zero variance); "-" prompts the parity of the characters' codes,
# which random completions split (a group of 4 agrees with probability 1/8)
MIXED_REWARD = """
def plus_is_hopeless(completions, prompts, **kwargs):
    return [
        0.0 if "+" in p else float(sum(map(ord, c)) % 7) for c, p in zip(completions, prompts)
    ]
"""


@pytest.fixture
def mixed_reward(tmp_path: Path) -> dict:
    path = tmp_path / "mixed_reward.py"
    path.write_text(MIXED_REWARD)
    return {"functions": [{"name": f"{path}:plus_is_hopeless"}]}


def _metrics(run_dir: Path) -> list[dict]:
    """Each step's metrics (without event rows, such as where a resume continued)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "event" not in row]


def test_trainer_never_passes_a_zero_variance_group(tiny_config, mixed_reward, monkeypatch) -> None:
    config = tiny_config(
        rewards=mixed_reward,
        algorithm={"preset": "dapo"},
        sampling={"max_rounds": 4},
        train={"steps": 3},
    )
    trainer = Trainer(config)
    trained: list[torch.Tensor] = []
    original = trainer.optimize

    def spy(scored: Scored) -> dict:
        trained.append(scored.rewards.clone())
        return original(scored)

    monkeypatch.setattr(trainer, "optimize", spy)
    run_dir = trainer.train()
    metrics = _metrics(run_dir)
    for rewards in trained:
        assert not zero_std_groups(rewards, 4).any()
    updates = [m for m in metrics if "loss" in m]
    assert len(updates) == len(trained)
    for m, rewards in zip(updates, trained, strict=True):
        assert m["sampling/prompts_kept"] == rewards.numel() // 4
    for m in metrics:
        assert m["sampling/prompts_kept"] <= 2 <= m["sampling/prompts_drawn"]
        assert 1 <= m["sampling/rounds"] <= 4


def greso_config(tiny_config, mixed_reward, **train) -> object:
    return tiny_config(
        rewards=mixed_reward,
        # no system prompt: the default one contains "2 + 3" and would hide the operator
        data={"task": "arithmetic", "task_args": {"size": 8}, "system_prompt": ""},
        algorithm={"beta": 0.0},
        sampling={"greso": True, "greso_history": 1, "greso_skip_prob": 1.0},
        rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        train={"steps": 8, "log_completions": 8, **train},
    )


def test_greso_skips_hopeless_prompts_after_one_epoch(tiny_config, mixed_reward) -> None:
    trainer = Trainer(greso_config(tiny_config, mixed_reward))
    plus = {i for i, row in enumerate(trainer.rows) if "+" in row["prompt"]}
    assert 0 < len(plus) < len(trainer.rows)
    run_dir = trainer.train()
    metrics = _metrics(run_dir)
    # the first epoch (4 steps of 2 prompts) visits every prompt once: nothing to skip yet
    assert all(m["greso/skipped"] == 0 for m in metrics[:4])
    # afterwards every "+" prompt has a zero-variance visit and skip_prob is 1
    assert sum(m["greso/skipped"] for m in metrics) >= len(plus)
    assert all(m["greso/rollouts_saved"] == 4 * m["greso/skipped"] for m in metrics)
    later = run_dir / "completions"
    for step in range(6, 9):
        rows = [json.loads(x) for x in (later / f"step-{step:06d}.jsonl").read_text().splitlines()]
        assert not any("+" in r["prompt"] for r in rows), step


def test_greso_resume_is_exact(tiny_config, mixed_reward, tiny_model_dir, weights) -> None:
    straight = Trainer(greso_config(tiny_config, mixed_reward, steps=8, run_name="a")).train()
    Trainer(greso_config(tiny_config, mixed_reward, steps=5, run_name="b")).train()
    resumed = Trainer(greso_config(tiny_config, mixed_reward, steps=8, run_name="b")).train()

    def strip(ms: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if "time" not in k and "per_s" not in k} for m in ms]

    assert strip(_metrics(straight)) == strip(_metrics(resumed))
    assert sum(m["greso/skipped"] for m in _metrics(resumed)[5:]) > 0  # history was restored
    final = weights.of(resumed / "final")
    weights.assert_moved(weights.of(tiny_model_dir), final)
    weights.assert_equal(weights.of(straight / "final"), final)


def test_the_trainer_keeps_a_multiple_of_its_ranks(tiny_config, monkeypatch) -> None:
    # 2 ranks (faked), one round of 4 prompts with 3 informative groups: 2 are kept, one each
    trainer = Trainer(
        tiny_config(rollout={"prompts_per_step": 4}, sampling={"dynamic": True, "max_rounds": 1})
    )
    trainer.producer.dist = replace(trainer.dist, world_size=2)
    script = Script([(4, [INFO, ZERO, INFO, INFO])])
    monkeypatch.setattr(trainer.producer, "sample", lambda n: (script(n), Round(0.0, 0.0, 0)))
    out = trainer.producer.collect(1).collected
    assert (out.prompts_drawn, out.prompts_kept) == (4, 2)
    assert out.train.rollout.completions[::G] == ["r1g0", "r1g2"]


def test_a_step_adds_up_its_rounds_seconds_and_skips(tiny_config, monkeypatch) -> None:
    # dynamic sampling: 1 informative group of 2 in the first round, so a second round of 2
    trainer = Trainer(
        tiny_config(rollout={"prompts_per_step": 2}, sampling={"dynamic": True, "max_rounds": 2})
    )
    script = Script([(2, [INFO, ZERO]), (2, [INFO, INFO])])
    spent = iter([Round(1.0, 2.0, 3), Round(10.0, 20.0, 30)])
    monkeypatch.setattr(trainer.producer, "sample", lambda n: (script(n), next(spent)))
    produced = trainer.producer.collect(1)
    assert produced.collected.rounds == 2
    assert (produced.rollout_s, produced.reward_s, produced.skipped) == (11.0, 22.0, 33.0)
    assert produced.temperature == trainer.producer.temperature.for_step(1)
    assert produced.ahead is None  # made in this process


def test_each_round_says_its_seconds_and_skips(tiny_config, monkeypatch) -> None:
    # two rounds of one prompt; every prompt is hopeless and skipped for sure, so each round
    # skips max_skips (one per row) before it takes one; a fake clock ticks in whole seconds
    import types

    import grpo.training.producer

    trainer = Trainer(tiny_config())
    rows = len(trainer.rows)
    hopeless = {i: [True] for i in range(rows)}
    trainer.producer.prompt_filter = PromptFilter(k=1, skip_prob=1.0, seed=0, history=hopeless)
    scored = fake_scored([ZERO], tag="g")  # zero variance again: the history stays hopeless
    monkeypatch.setattr(trainer.producer, "rollout", lambda draws: scored.rollout)
    monkeypatch.setattr(trainer.producer, "score", lambda rollout: scored)
    ticks = iter([0.0, 10.0, 11.0, 100.0, 130.0, 132.0])  # start, rolled out, scored; twice
    monkeypatch.setattr(
        grpo.training.producer, "time", types.SimpleNamespace(perf_counter=ticks.__next__)
    )
    first, second = (trainer.producer.sample(1)[1] for _ in range(2))
    # rollout 10 - 0 and 130 - 100 s, rewards 11 - 10 and 132 - 130 s
    assert (first, second) == (Round(10.0, 1.0, rows), Round(30.0, 2.0, rows))
