"""Checkpoints of a training run: what a ``checkpoints/step-N`` folder holds and how it is
written and read back. The run directory (``grpo.runs.directory``) owns the folder's life
(temp names, manifest, rename, verification); this module owns its contents.

A checkpoint is the HF folder of the policy plus ``trainer_state.pt``: the training state's
``state_dict`` (``grpo.training.state``: step, data position, optimizer and the float32 master
weights of a bf16 policy, scheduler, RNG, GRESO's history, the temperature controller, the
reward-hacking watch's windows, the entropy bonus's coefficient, the reference when it is
refreshed, PPO's critic with its optimizer state and, for LoRA, the adapter weights) and the
world size. Ranks other than 0 add their RNG state in ``rng-rank{r}.pt``.
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from grpo.config import Config
from grpo.models import save_hf
from grpo.runs.directory import RunDir, RunDirError
from grpo.runtime import distributed
from grpo.runtime.distributed import DistInfo
from grpo.training.optimizer import apply_optim_config
from grpo.training.state import TrainingState, capture_rng

# modules and classes renamed since a checkpoint may have been written: its steps made ahead
# (``ahead``) are pickled objects (the producer process's, holding scored rollouts)
MOVED = {
    "grpo.training.ahead": "grpo.training.producer_process",
    "grpo.containers": "grpo.step_data",
}
RENAMED = {("grpo.scoring.distribution", "Sampling"): "Decoding"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED.get(module, module), RENAMED.get((module, name), name))


class _MovedPickle:
    """``torch.load``'s pickle module, reading classes under their current module names."""

    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    __name__ = "pickle"


def save_torch(obj: Any, path: Path) -> None:
    # through a Python file, so a full disk raises OSError(ENOSPC) (torch's own writer only says
    # "unexpected pos")
    with path.open("wb") as f:
        torch.save(obj, f)


def load_torch(path: Path) -> Any:
    return torch.load(path, weights_only=False, pickle_module=_MovedPickle)


@dataclass(frozen=True)
class WrittenWith:
    """What a checkpoint or the final model is written with besides the training state: the
    ranks, the tokenizer saved beside the weights, the run's config and its inputs' fingerprints
    (for the manifest)."""

    dist: DistInfo
    tokenizer: PreTrainedTokenizerBase
    config: Config
    inputs: dict[str, Any]

    def manifest_meta(self) -> dict[str, Any]:
        return {
            "world_size": self.dist.world_size,
            "run_config": self.config.model_dump(mode="json"),
            "inputs": self.inputs,
        }


def save_checkpoint(state: TrainingState, run: RunDir, written: WrittenWith) -> None:
    """Write ``checkpoints/step-N`` of ``state`` (all ranks take part; rank 0 seals and renames
    it)."""
    step, dist, main = state.step, written.dist, written.dist.is_main
    tmp = run.checkpoint_temp(step)
    if main:
        run.fresh_temp(tmp)
    distributed.barrier()  # tmp exists before any rank writes into it
    with run.cleanup_on_error(tmp) if main else contextlib.nullcontext():
        save_model(state.policy, written.tokenizer, tmp, written.dist)
        optimizer = distributed.optimizer_state(state.policy, state.optimizer)  # all ranks
        if main:
            trainer_state = {**state.state_dict(optimizer), "world_size": dist.world_size}
            save_torch(trainer_state, tmp / "trainer_state.pt")
        else:
            # ranks > 0 only add their RNG state; rank 0 writes everything else
            save_torch({"rng": capture_rng()}, tmp / f"rng-rank{dist.rank}.pt")
        distributed.barrier()  # every rank's files are in tmp
        if main:
            run.commit_checkpoint(step, written.manifest_meta(), written.config.train.keep_last)
    distributed.barrier()
    run.intact = run.checkpoints / f"step-{step}"  # on every rank


def save_final(state: TrainingState, run: RunDir, written: WrittenWith) -> None:
    """Write ``final/`` the way checkpoints are written (temp name, manifest, rename)."""
    dist = written.dist
    tmp = run.final_temp()
    if dist.is_main:
        run.fresh_temp(tmp)
    distributed.barrier()
    with run.cleanup_on_error(tmp) if dist.is_main else contextlib.nullcontext():
        save_model(state.policy, written.tokenizer, tmp, written.dist)
        if dist.is_main:
            run.commit_final(state.step, written.manifest_meta())
    distributed.barrier()  # the run is complete on disk before any rank returns


def save_model(
    policy: nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path, dist: DistInfo
) -> None:
    """Rank 0 writes the HF folder; under FSDP2 every rank first helps gather the weights."""
    if distributed.is_fsdp(policy):
        state = distributed.full_state_dict(policy)
        if dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            policy.save_pretrained(path, state_dict=state)
            tokenizer.save_pretrained(path)
    elif dist.is_main:
        save_hf(policy, tokenizer, path)


def load_checkpoint(state: TrainingState, path: Path, *, dist: DistInfo, config: Config) -> None:
    """Restore ``state`` from ``path``; a checkpoint that does not fit the model is one line."""
    try:
        _load_checkpoint(state, path, dist, config)
    except (torch.OutOfMemoryError, torch.distributed.DistError):
        raise  # the machine's trouble, not the checkpoint's
    except (RuntimeError, ValueError, KeyError) as err:  # shapes, names, optimizer groups
        said = " ".join(str(err).split()) or type(err).__name__  # torch's spans lines
        raise RunDirError(
            f"checkpoint {path} does not fit the model {config.model.name} as "
            f"configured (were its files changed?): {said[:300]}"
        ) from None


def _load_checkpoint(state: TrainingState, path: Path, dist: DistInfo, config: Config) -> None:
    saved = load_torch(path / "trainer_state.pt")
    load_weights(state.policy, path, saved["trainable"])
    if not dist.is_main:
        saved["rng"] = load_torch(path / f"rng-rank{dist.rank}.pt")["rng"]
    state.load_state_dict(saved)
    apply_optim_config(state.optimizer, state.scheduler, config.optim)


def load_weights(policy: nn.Module, path: Path, trainable: dict[str, Tensor] | None) -> None:
    """The policy's weights: LoRA's adapters (``trainable``), else the checkpoint's HF folder."""
    from safetensors.torch import load_file

    if trainable is not None:
        policy.load_state_dict(trainable, strict=False)
        return
    weights: dict[str, Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    missing, unexpected = distributed.load_full_state_dict(policy, weights)
    # tied weights (the LM head) are saved once under the embedding's name
    tied = set(getattr(policy, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"checkpoint {path} does not match the model: "
            f"{(unexpected or sorted(set(missing) - tied))[:3]}"
        )
