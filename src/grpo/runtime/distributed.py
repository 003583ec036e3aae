"""Multi-process training under ``torchrun``: process group, collectives, DDP and FSDP2 wrapping.

One process per device. ``init_from_env`` reads the variables ``torchrun`` sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``) and starts the process group: NCCL when CUDA is available, gloo on
CPU. Without those variables everything here is a cheap no-op, so a single process needs no
launcher. Each rank owns whole prompt groups; the helpers below turn local counts and rows into
global ones so that a run on W ranks computes what one process with the same global batch would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

Strategy = Literal["ddp", "fsdp"]
T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank in [0, world_size), its device, and whether it writes files."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_from_env() -> DistInfo:
    """Join the process group ``torchrun`` describes in the environment (once per process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------- sharding


def shard_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of ``total`` items, in rank order.

    Equal shares when ``total`` divides evenly; otherwise the shares differ by at most one item
    (the last ranks get one more) and a rank may get none (dynamic sampling's later rounds).
    """
    return rank * total // world_size, (rank + 1) * total // world_size


# --------------------------------------------------------------------------------------- collectives


def _comm_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(value: float, op: str = "sum") -> float:
    """A Python number reduced over ranks with ``op`` in sum | min | max (itself on one process)."""
    if not active():
        return float(value)
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=ops[op])
    return float(t.item())


def local_share_of_global(count: float) -> float:
    """``sum over ranks of count / world_size``.

    DDP averages gradients over ranks. A loss normalised by a global count C (dapo's token count)
    must therefore be divided by C / W on each rank, so that the average of the W rank gradients is
    the gradient of (sum of all ranks' terms) / C.
    """
    if not active():
        return float(count)
    return all_reduce(count, "sum") / dist.get_world_size()


def all_gather_rows(t: Tensor, pad_value: float | int | bool = 0) -> Tensor:
    """Concatenate every rank's tensor along dim 0, in rank order.

    t: [n_r, ...] with n_r and the trailing sizes free to differ between ranks; trailing dims are
    padded at the end with ``pad_value`` to the largest size. Returns [sum_r n_r, ...].
    """
    if not active():
        return t
    world = dist.get_world_size()
    device = _comm_device()
    shape = torch.tensor(t.shape, dtype=torch.long, device=device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    sizes = torch.stack(shapes).cpu()  # [W, ndim]
    target = sizes.max(dim=0).values.tolist()
    padded = torch.full(target, pad_value, dtype=t.dtype, device=device)
    padded[tuple(slice(0, s) for s in t.shape)] = t.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    # gloo and NCCL do not all-gather bool tensors; move them as uint8
    if padded.dtype == torch.bool:
        parts8 = [p.to(torch.uint8) for p in parts]
        dist.all_gather(parts8, padded.to(torch.uint8))
        parts = [p.bool() for p in parts8]
    else:
        dist.all_gather(parts, padded)
    rows = [p[: int(n)] for p, n in zip(parts, sizes[:, 0], strict=True)]
    return torch.cat(rows).to(t.device)


def all_gather_list(items: list[Any]) -> list[Any]:
    """Concatenate every rank's list of picklable items, in rank order."""
    if not active():
        return list(items)
    out: list[list[Any]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


def from_main(fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 only (e.g. a decision about files only it reads); its result, or
    the exception it raised, reaches every rank, so all ranks go on or stop together."""
    if not active():
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, fn())]
        except Exception as err:  # re-raised on every rank below
            box = [(False, err)]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def rank_slice(n_local: int) -> slice:
    """Where this rank's ``n_local`` rows sit in a tensor gathered by ``all_gather_rows``."""
    if not active():
        return slice(0, n_local)
    counts = all_gather_rows(torch.tensor([n_local])).tolist()
    start = sum(counts[: dist.get_rank()])
    return slice(start, start + n_local)


# --------------------------------------------------------------------------------------- wrapping


def wrap_model(model: nn.Module, strategy: Strategy, info: DistInfo) -> nn.Module:
    """The module to run training forwards through.

    ddp: a ``DistributedDataParallel`` wrapper (``model`` itself stays the plain module, used for
    generation and saving). fsdp: FSDP2 ``fully_shard`` on every decoder layer and then the whole
    model, in place; the returned object is ``model``. One process: ``model`` unchanged.
    """
    if not info.enabled:
        return model
    if strategy == "ddp":
        ids = [info.device.index] if info.device.type == "cuda" else None
        return TransparentDDP(model, device_ids=ids)
    fully_shard_model(model, info)
    return model


class TransparentDDP(nn.parallel.DistributedDataParallel):
    """DDP that reads attributes it lacks (``config``, checkpointing flags) from the wrapped model.

    Code that takes "a model" (log-prob functions building a KV cache from ``model.config``) then
    works on the wrapper as on the HF model, while its forwards still go through DDP's hooks.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: HF models list them in a ModuleList named ``layers``/``h``."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in {"layers", "h"}:
            return list(module)
    return []


def fully_shard_model(model: nn.Module, info: DistInfo) -> None:
    """FSDP2: shard each decoder layer, then the rest (embeddings, norm, head), over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the cross-rank gradient reduction when ``enabled`` is False (accumulating micro-batches).

    Only the backward of the last micro-batch of an optimizer step needs to synchronise: DDP and
    FSDP2 then reduce the accumulated gradient once.
    """
    if enabled or not active():
        yield
        return
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    if is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """Keep an FSDP2 model's parameters gathered for a while (generation: forwards per rank differ).

    Unsharded parameters with resharding switched off make every forward local, so ranks may run
    different numbers of decoding steps without waiting for each other. A no-op for other models.
    """
    if not is_fsdp(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for m in fsdp_modules:
        m.unshard()
    try:
        yield
    finally:
        for m in fsdp_modules:
            m.reshard()
        model.set_reshard_after_forward(True)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The complete, unsharded state dict on every rank (a collective under FSDP2).

    Tied parameters (input embedding = LM head) map to one tensor, as in the module itself, so
    ``save_pretrained`` writes them once.
    """
    if not is_fsdp(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and name in state:
            state[name] = state[first[id(param)]]
        first.setdefault(id(param), name)
    return state


def as_float(value: Tensor | float) -> float:
    """A scalar that may be a DTensor (FSDP2 grad norm) as a Python float."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def load_full_state_dict(model: nn.Module, state: dict[str, Tensor]) -> Any:
    """Load a complete state dict (every rank holds it) into a plain or FSDP2 model, not strict.

    Returns the (missing, unexpected) keys as ``load_state_dict`` does.
    """
    if not is_fsdp(model):
        return model.load_state_dict(state, strict=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, strict=False)
    return set_model_state_dict(model, state, options=options)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's complete state (gathered from the shards under FSDP2: a collective)."""
    if not is_fsdp(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Inverse of ``optimizer_state``: each FSDP2 rank keeps its own shard of the full state."""
    if not is_fsdp(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)
