"""Multi-process training: sharding helpers, seeded sampling, and torchrun (gloo) == one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from grpo.config import ConfigError, dump_config
from grpo.data.stream import sampling_seed
from grpo.models import load_tokenizer
from grpo.rollout.hf import HFEngine
from grpo.rollout.sampler import SeededGroupSampler
from grpo.runtime import distributed
from grpo.training.trainer import Trainer, train

DIGITS_REWARD = """
def digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def digits_if_even(completions, answer, **kwargs):
    # zero variance (dropped by dynamic sampling) unless the answer divides by 3
    return [
        sum(ch.isdigit() for ch in c) / max(len(c), 1) if int(a) % 3 == 0 else 0.0
        for c, a in zip(completions, answer)
    ]
"""


def test_shard_bounds_split_whole_groups_evenly() -> None:
    # 4 prompts over 2 ranks: rank 0 takes prompts 0-1, rank 1 prompts 2-3
    assert distributed.shard_bounds(4, 0, 2) == (0, 2)
    assert distributed.shard_bounds(4, 1, 2) == (2, 4)
    # uneven (a dynamic-sampling round): shares differ by at most one, in rank order
    assert [distributed.shard_bounds(5, r, 2) for r in range(2)] == [(0, 2), (2, 5)]
    assert [distributed.shard_bounds(1, r, 2) for r in range(2)] == [(0, 0), (0, 1)]


def test_single_process_collectives_are_identities() -> None:
    t = torch.arange(6.0).view(3, 2)
    assert distributed.all_gather_rows(t) is t
    assert distributed.rank_slice(3) == slice(0, 3)
    assert distributed.all_reduce(2.5) == 2.5
    assert distributed.local_share_of_global(7.0) == 7.0
    assert distributed.all_gather_list(["a"]) == ["a"]


def test_sampling_seeds_differ_per_position_and_run_seed() -> None:
    seeds = {sampling_seed(s, p) for s in range(3) for p in range(1000)}
    assert len(seeds) == 3000


def test_seeded_sampler_draws_from_the_softmax() -> None:
    # probabilities 0.5, 0.3, 0.2 and a -inf token that must never be drawn; 5 groups of 800
    # rows = 4000 draws: frequencies within 0.025 (binomial std <= sqrt(0.25/4000) = 0.008)
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    scores = probs.log().expand(4000, 4).clone()
    sampler = SeededGroupSampler([1, 2, 3, 4, 5], group_size=800, device=torch.device("cpu"))
    picks = sampler(None, scores).argmax(dim=-1)  # [4000]
    freq = torch.bincount(picks, minlength=4).float() / 4000
    assert freq[3] == 0
    assert torch.allclose(freq, probs, atol=0.025)


def test_a_groups_samples_do_not_depend_on_its_batch(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.config import RolloutConfig

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, tok, RolloutConfig(max_new_tokens=8))
    prompts = ["1+1?", "a much longer prompt, 2+2?"]
    rows = [{"prompt": p} for p in prompts]
    both = engine.generate(prompts, rows, 3, seeds=[11, 22])
    alone = engine.generate(prompts[1:], rows[1:], 3, seeds=[22])
    # the second group alone (other padding, other batch) draws the same completions
    assert both.completions[3:] == alone.completions
    other = engine.generate(prompts[1:], rows[1:], 3, seeds=[23])
    assert other.completions != alone.completions


# --------------------------------------------------------------------------------------- torchrun


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        out.update(load_file(file))
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _torchrun(recipe: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", "grpo.cli", "train", str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _one_then_two_ranks(config, tmp_path: Path) -> tuple[Path, Path]:
    """``config`` trained in this process (run "one"), then as a recipe by two gloo ranks (run
    "two", beside it)."""
    one = train(config)
    recipe = tmp_path / "recipe.yaml"
    tree = yaml.safe_load(dump_config(config))
    tree["train"]["run_name"] = "two"
    recipe.write_text(yaml.safe_dump(tree))
    proc = _torchrun(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return one, one.parent / "two"


@pytest.fixture
def distributed_run(tiny_config, tmp_path: Path):
    """A factory: (algorithm section) -> (single-process run dir, 2-rank run dir, config)."""
    reward = tmp_path / "digits_reward.py"
    reward.write_text(DIGITS_REWARD)

    def run(algorithm: dict, strategy: str = "ddp", sampling: dict | None = None):
        config = tiny_config(
            rewards={
                "functions": [{"name": f"{reward}:{'digits_if_even' if sampling else 'digits'}"}]
            },
            sampling=sampling or {},
            rollout={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
            optim={"lr": 1e-3, "micro_batch_size": 4},
            algorithm=algorithm,
            train={"steps": 3, "run_name": "one", "threads": 1, "distributed": strategy},
        )
        one, two = _one_then_two_ranks(config, tmp_path)
        return one, two, config

    return run


@pytest.mark.parametrize(
    "algorithm",
    [
        pytest.param({"loss_type": "grpo", "beta": 0.0}, marks=pytest.mark.slow),
        pytest.param({"_strategy": "fsdp"}, marks=pytest.mark.slow),
        # DAPO with dynamic sampling: every rank sees every round, then takes an equal share;
        # dapo's global token count, the std over the whole batch of kept groups, and a
        # reference model (beta 0.04)
        {
            "preset": "dapo",
            "scale_rewards": "batch",
            "beta": 0.04,
            "_sampling": {"dynamic": True, "max_rounds": 4},
        },
        # REINFORCE++'s normalisation over every rank's tokens, KL in the rewards, an entropy
        # bonus through DDP
        {"estimator": "reinforce_pp", "beta": 0.1, "entropy_coef": 0.05},
        pytest.param({"reward_aggregation": "gdpo"}, marks=pytest.mark.slow),
    ],
    ids=["grpo", "fsdp2", "dapo-dynamic-batch-std", "reinforce_pp-entropy", "gdpo"],
)
def test_two_gloo_ranks_match_one_process(
    distributed_run, tiny_model_dir: Path, algorithm: dict
) -> None:
    # one process with P=4 prompts vs two ranks with 2 prompts each, same seed, 3 steps
    algorithm = dict(algorithm)
    strategy = algorithm.pop("_strategy", "ddp")
    sampling = algorithm.pop("_sampling", None)
    one, two, config = distributed_run(algorithm, strategy, sampling)
    a, b, start = _weights(one / "final"), _weights(two / "final"), _weights(tiny_model_dir)
    assert a.keys() == b.keys()
    # training moved the weights by far more than the tolerance of the comparison
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=0), key
    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m2] == [1, 2, 3]  # only rank 0 wrote, once per step
    for r1, r2 in zip(m1, m2, strict=True):
        for key in ("reward/mean", "reward/std", "advantage/abs_mean", "completion_len/mean"):
            assert r1[key] == pytest.approx(r2[key], abs=1e-6), key
        for key in ("loss", "grad_norm", "entropy"):
            assert r1[key] == pytest.approx(r2[key], abs=1e-5), key
    # the same completions were sampled and written, in the same global order
    c1 = (one / "completions" / "step-000003.jsonl").read_text()
    c2 = (two / "completions" / "step-000003.jsonl").read_text()
    assert c1 == c2
    if sampling:  # the test saw rounds of several sizes and groups dropped
        for r1, r2 in zip(m1, m2, strict=True):
            for key in ("sampling/prompts_drawn", "sampling/prompts_kept", "sampling/rounds"):
                assert r1[key] == r2[key], key
        assert max(m["sampling/rounds"] for m in m1) > 1

    # a checkpoint written by 2 ranks cannot be resumed by 1 process
    resume = config.model_copy(
        update={"train": config.train.model_copy(update={"run_name": "two", "steps": 4})}
    )
    with pytest.raises(ConfigError, match="written by 2 process"):
        Trainer(resume).train()


def test_gathered_groups_can_be_trained_on(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from gather_worker import gather_worker

    out = tmp_path / "gathered.pt"
    mp.spawn(gather_worker, args=(f"file://{tmp_path / 'store'}", str(out)), nprocs=2)
    result = torch.load(out, weights_only=False)
    first = result["empty_first"]
    assert first.rollout.completions == ["c3", "c3"] and first.rollout.rows == [{"prompt": "p"}]
    assert first.rollout.prompt_mask.all() and first.rollout.prompt_ids.shape == (2, 3)
    assert torch.equal(first.rollout.sampler_logp, torch.full((2, 3), -1.0))
    assert first.rollout.decoding.temperature == 0.5  # rank 0 sampled nothing: rank 1's controls
    assert first.errors == {"r": 2}
    wide = result["widths"].rollout
    assert wide.prompt_mask.shape == (4, 4)
    # rank 0's 2-token prompts are left padded: mask 0011, ids 0077
    assert wide.prompt_mask[:2].tolist() == [[False, False, True, True]] * 2
    assert wide.prompt_ids[:2].tolist() == [[0, 0, 7, 7]] * 2
    assert wide.prompt_mask[2:].all()


def test_a_rank_without_prompts_scores_an_empty_rollout(tiny_config) -> None:
    from grpo.training.gather import empty_rollout

    trainer = Trainer(tiny_config())
    scored = trainer.producer.score(empty_rollout(4))
    assert scored.rewards.shape == (0,)
    assert scored.per_function.shape == (0, len(scored.function_names))
    assert scored.advantages.shape == (0,)


GUESSED_REWARD = """
def guessed(completions, environments, **kwargs):
    # the episodes' live instances: the seeded hidden number varies within a group
    return [float(len(e.guesses)) + 0.1 * e.target for e in environments]
"""


def test_two_gloo_ranks_play_an_environment_as_one_process(tiny_config, tmp_path: Path) -> None:
    # each rank plays its own prompts' episodes, seeded by the prompt: the same episodes, hidden
    # numbers and weights as one process playing them all
    reward = tmp_path / "guessed.py"
    reward.write_text(GUESSED_REWARD)
    envs = Path(__file__).parents[1] / "environments" / "trl_envs.py"
    functions = [{"name": "environment"}, {"name": f"{reward}:guessed"}, {"name": "format"}]
    config = tiny_config(
        rewards={"functions": functions},
        rollout={
            "environment": f"{envs}:GuessNumber",
            "prompts_per_step": 4,
            "group_size": 4,
            "max_new_tokens": 12,
            "max_turns": 2,
        },
        optim={"lr": 1e-3, "micro_batch_size": 4},
        train={"steps": 2, "run_name": "one", "threads": 1},
    )
    one, two = _one_then_two_ranks(config, tmp_path)
    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m2] == [1, 2]
    for r1, r2 in zip(m1, m2, strict=True):
        assert r1["reward/guessed/std"] > 0  # the hidden numbers differ: there is a gradient
        for key in ("reward/guessed/mean", "reward/environment/mean", "env/turns", "env/errors"):
            assert r1[key] == pytest.approx(r2[key], abs=1e-6), key
    c1 = (one / "completions" / "step-000002.jsonl").read_text()
    assert c1 == (two / "completions" / "step-000002.jsonl").read_text()
    a, b = _weights(one / "final"), _weights(two / "final")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=0), key
