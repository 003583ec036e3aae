"""Checkpoints of a training run: what a ``checkpoints/step-N`` folder holds and how it is
written and read back. The run directory (``grpo.runs.directory``) owns the folder's life
(temp names, manifest, rename, verification); this module owns its contents.

A checkpoint is the HF folder of the policy plus ``trainer_state.pt``: step, data position,
optimizer (and the float32 master weights of a bf16 policy), scheduler, RNG (rank 0's; other
ranks add ``rng-rank{r}.pt``), GRESO's history, the temperature controller, the reward-hacking
watch's windows, the entropy bonus's coefficient, the reference (when it is refreshed), PPO's
critic with its optimizer state and, for LoRA, the adapter weights.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo.models import is_lora, save_hf
from grpo.runs.directory import RunDirError
from grpo.runtime import distributed
from grpo.training.optimizer import apply_optim_config, load_master_state, master_state

if TYPE_CHECKING:
    from grpo.training.trainer import Trainer


def save_torch(obj: Any, path: Path) -> None:
    # through a Python file, so a full disk raises OSError(ENOSPC) (torch's own writer only says
    # "unexpected pos")
    with path.open("wb") as f:
        torch.save(obj, f)


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def manifest_meta(t: Trainer) -> dict[str, Any]:
    return {
        "world_size": t.dist.world_size,
        "run_config": t.config.model_dump(mode="json"),
        "inputs": t.inputs,
    }


def trainer_state(t: Trainer, optimizer: dict[str, Any]) -> dict[str, Any]:
    """Everything but the weights that a resume needs to continue bit for bit."""
    return {
        "step": t.step,
        **t.producer.state_dict(),  # consumed, greso, temperature
        "world_size": t.dist.world_size,
        "optimizer": optimizer,
        # float32 masters of bf16 weights (grpo.training.optimizer); the HF folder holds them
        # rounded, and a resume from those alone would lose what rounding dropped
        "master": master_state(t.policy, t.optimizer),
        "scheduler": t.scheduler.state_dict(),
        "rng": capture_rng(),
        "hack_watch": t.hack_watch.state_dict(),
        "entropy_bonus": t.entropy_bonus.state_dict(),
        "reference": None if t.reference is None else t.reference.state_dict(),
        "critic": None if t.critic is None else t.critic.state_dict(),  # estimator ppo
        # LoRA: only the adapters train
        "trainable": {k: v for k, v in t.policy.state_dict().items() if "lora_" in k}
        if is_lora(t.policy)
        else None,
    }


def save_checkpoint(t: Trainer) -> None:
    """Write ``checkpoints/step-N`` (all ranks take part; rank 0 seals and renames it)."""
    run, main = t.run, t.dist.is_main
    tmp = run.checkpoint_temp(t.step)
    if main:
        run.fresh_temp(tmp)
    distributed.barrier()  # tmp exists before any rank writes into it
    with run.cleanup_on_error(tmp) if main else contextlib.nullcontext():
        save_model(t, tmp)
        optimizer = distributed.optimizer_state(t.policy, t.optimizer)  # all ranks
        if main:
            save_torch(trainer_state(t, optimizer), tmp / "trainer_state.pt")
        else:
            # ranks > 0 only add their RNG state; rank 0 writes everything else
            save_torch({"rng": capture_rng()}, tmp / f"rng-rank{t.dist.rank}.pt")
        distributed.barrier()  # every rank's files are in tmp
        if main:
            run.commit_checkpoint(t.step, manifest_meta(t), t.config.train.keep_last)
    distributed.barrier()
    t.saved_step = t.step
    run.intact = run.checkpoints / f"step-{t.step}"  # on every rank


def save_final(t: Trainer) -> None:
    """Write ``final/`` the way checkpoints are written (temp name, manifest, rename)."""
    run, main = t.run, t.dist.is_main
    tmp = run.final_temp()
    if main:
        run.fresh_temp(tmp)
    distributed.barrier()
    with run.cleanup_on_error(tmp) if main else contextlib.nullcontext():
        save_model(t, tmp)
        if main:
            run.commit_final(t.step, manifest_meta(t))
    distributed.barrier()  # the run is complete on disk before any rank returns


def save_model(t: Trainer, path: Path) -> None:
    """Rank 0 writes the HF folder; under FSDP2 every rank first helps gather the weights."""
    if distributed.is_fsdp(t.policy):
        state = distributed.full_state_dict(t.policy)
        if t.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            t.policy.save_pretrained(path, state_dict=state)
            t.tokenizer.save_pretrained(path)
    elif t.dist.is_main:
        save_hf(t.policy, t.tokenizer, path)


def load_checkpoint(t: Trainer, path: Path) -> None:
    """Restore ``t`` from ``path``; a checkpoint that does not fit the model is one line."""
    try:
        _load_checkpoint(t, path)
    except (torch.OutOfMemoryError, torch.distributed.DistError):
        raise  # the machine's trouble, not the checkpoint's
    except (RuntimeError, ValueError, KeyError) as err:  # shapes, names, optimizer groups
        said = " ".join(str(err).split()) or type(err).__name__  # torch's spans lines
        raise RunDirError(
            f"checkpoint {path} does not fit the model {t.config.model.name} as "
            f"configured (were its files changed?): {said[:300]}"
        ) from None


def _load_checkpoint(t: Trainer, path: Path) -> None:
    from safetensors.torch import load_file

    state = torch.load(path / "trainer_state.pt", weights_only=False)
    if state["trainable"] is not None:
        t.policy.load_state_dict(state["trainable"], strict=False)
    else:
        weights: dict[str, Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            weights.update(load_file(file))
        missing, unexpected = distributed.load_full_state_dict(t.policy, weights)
        # tied weights (the LM head) are saved once under the embedding's name
        tied = set(getattr(t.policy, "_tied_weights_keys", None) or ())
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"checkpoint {path} does not match the model: "
                f"{(unexpected or sorted(set(missing) - tied))[:3]}"
            )
    load_master_state(t.policy, t.optimizer, state.get("master"))
    distributed.load_optimizer_state(t.policy, t.optimizer, state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    apply_optim_config(t.optimizer, t.scheduler, t.config.optim)
    if t.dist.is_main:
        restore_rng(state["rng"])
    else:
        restore_rng(torch.load(path / f"rng-rank{t.dist.rank}.pt", weights_only=False)["rng"])
    t.producer.load_state_dict(state)
    if state.get("hack_watch"):  # a checkpoint from before the watch starts it afresh
        t.hack_watch.load_state_dict(state["hack_watch"])
    if state.get("entropy_bonus"):
        t.entropy_bonus.load_state_dict(state["entropy_bonus"])
    if t.reference is not None and state.get("reference"):
        t.reference.load_state_dict(state["reference"])
    if t.critic is not None:
        if not state.get("critic"):
            raise ValueError("the checkpoint holds no critic (saved by another estimator)")
        t.critic.load_state_dict(state["critic"])
    t.step = t.saved_step = state["step"]
    t.run.intact = path
    t.producer.sync_weights(t.step, changed=True)  # the engine samples from the restored weights
