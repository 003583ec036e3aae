"""Shared fixtures: a tiny random model and tokenizer built locally (no downloads), a reward
that model can move from its first step, and a check that training really moved the weights."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from grpo.config import Config, build_config
from grpo.models import build_tiny_model

TOY_REWARDS = Path(__file__).with_name("toy_rewards.py")
# a reward with within-group variance from step 1 (see toy_rewards.py): with it every group has a
# non-zero advantage, so loss, gradient and the weights move on every step
TRAINABLE_REWARD = {"name": f"{TOY_REWARDS}:lowercase_share"}


def _warm_up_for_mutation() -> None:
    """Under ``make mutate`` every mutant's pytest is forked from one process that collected the
    tests (mutmut's fork server, which imports this file). What each fork would otherwise redo
    is done here once: transformers imports a model's code, attention and generation helpers on
    first use (about 2 s per process). One torch thread, set before any tensor op, keeps the
    forks safe (OpenMP's thread pool does not survive a fork: the child hangs) and suits one
    mutant per core."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = build_tiny_model(Path(folder) / "model")
        model, tokenizer = (
            AutoModelForCausalLM.from_pretrained(path),
            AutoTokenizer.from_pretrained(path),
        )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "1+1"}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=True)
        model(ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()


# One torch thread here and in the processes the tests start, unless the environment says
# otherwise: the tiny model's products are too small to split, and two threads waiting on each
# other spin while the other is descheduled (on a loaded 2-core machine the trainer tests took
# several times the CPU with two threads; idle, the two were alike). train.threads still sets a
# run's count (tests/test_build.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

MUTATION_RUN = "MUTANT_UNDER_TEST" in os.environ  # set by mutmut in all its processes
if MUTATION_RUN:
    _warm_up_for_mutation()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="device of the tests marked `device` (their models and tensors; the trainer's own "
        "choice is CUDA when torch sees it). Another device than cpu runs only those tests "
        "(`make gpu-check`)",
    )


def pytest_configure(config: pytest.Config) -> None:
    device = torch.device(config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: torch {torch.__version__} sees no CUDA device")
    if device.type == "cuda":
        # cuBLAS picks its reduction order per call unless told (the ``deterministic`` fixture)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--device") != "cpu":
        # the other tests build their tensors on the CPU: on another device only these run
        kept = [item for item in items if item.get_closest_marker("device")]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    if MUTATION_RUN:
        # a mutant stops at its first failing test (-x), and mutmut hands pytest its tests in a
        # set's arbitrary order: fastest first, by the durations mutmut measured, so a killed
        # mutant rarely waits for a trainer
        durations = _measured_durations()
        items.sort(key=lambda item: durations.get(item.nodeid, 0.0))


def _measured_durations() -> dict[str, float]:
    """Test id -> seconds, as mutmut measured them (it runs the tests from mutants/, where it
    keeps them); none while it measures them."""
    try:
        return json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device of the tests marked ``device`` (``--device``, cpu by default)."""
    return torch.device(request.config.getoption("--device"))


@pytest.fixture
def deterministic(device: torch.device):
    """Deterministic kernels for a test that compares two runs bit for bit: on CUDA, two runs of
    the same float32 step otherwise differ in the last bits (1e-7, measured on an H200)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 64) with a character tokenizer and a chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    # aliases build into a per-session cache, never into the user's home
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path_factory.getbasetemp() / "model-cache"))
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def trainable_reward() -> dict:
    """A rewards section with only the trainable reward (``reward/lowercase_share/mean``)."""
    return {"functions": [dict(TRAINABLE_REWARD)]}


@pytest.fixture
def tiny_config(tiny_model_dir: Path, tmp_path: Path):
    """A factory: tiny_config(**sections) -> Config for a fast run in tmp_path.

    The default rewards are the arithmetic task's (format, accuracy), which the random model
    never earns, plus the trainable reward, so a run with the defaults really trains.
    """

    def make(**sections: dict) -> Config:
        tree: dict = {
            # float32 as the tests' references compute; `auto` would measure each machine
            "model": {"name": str(tiny_model_dir), "precision": "float32"},
            "data": {"task": "arithmetic", "task_args": {"size": 64}},
            "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
            "rewards": {
                "functions": [{"name": "format"}, {"name": "accuracy"}, dict(TRAINABLE_REWARD)]
            },
            "optim": {"lr": 1e-3, "micro_batch_size": 4},
            "train": {
                "steps": 2,
                "output_dir": str(tmp_path / "runs"),
                "run_name": "t",
                "progress": False,
                "sinks": ["jsonl"],
            },
        }
        for key, value in sections.items():
            tree[key] = {**tree.get(key, {}), **value}
        return build_config(tree)

    return make


class Weights:
    """Snapshots of a model's weights, and the check every training test starts with."""

    @staticmethod
    def of(source: Path | nn.Module) -> dict[str, torch.Tensor]:
        """A copy of the weights of a module, or of the safetensors files of an HF folder."""
        if isinstance(source, nn.Module):
            return {k: v.detach().clone() for k, v in source.state_dict().items()}
        out: dict[str, torch.Tensor] = {}
        for file in sorted(Path(source).glob("*.safetensors")):
            out.update(load_file(file))
        assert out, f"no weights in {source}"
        return out

    @staticmethod
    def assert_moved(
        before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], atol: float = 1e-4
    ) -> float:
        """Training changed some weight by more than ``atol``; returns the largest change.

        A trainer test whose weights never move passes for any trainer: assert this first.
        """
        shared = before.keys() & after.keys()
        assert shared, "the two snapshots share no weight name"
        moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in shared)
        assert moved > atol, f"training did not move the weights (largest change {moved:.2e})"
        return moved

    @staticmethod
    def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
        """Bit-identical weights under the same names."""
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


@pytest.fixture
def weights() -> type[Weights]:
    return Weights
