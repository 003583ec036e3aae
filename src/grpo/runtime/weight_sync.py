"""Weights from the trainer to a producer process: one flat buffer per push, broadcast over a
two-process gloo group of their own (a ``TCPStore`` on a free port, not the default group, so it
never meets ``torchrun``'s collectives).

Only the run's own peer gets the weights: the trainer's store and its gloo listener bind to the
one address the peer uses (loopback for the producer process; ``rollout.server_weights_host``
for ``grpo serve``), not to every interface as torch's own would, and the peer proves it holds
the run's ``secret`` (passed over the channel that started it: the spawn pipe, or grpo serve's
token-checked ``/weights/init``) before the first push, so a process that raced it into the
group receives nothing.

Only the parameters that train move (``trainable``): full weights, or a LoRA policy's adapters;
the frozen rest is loaded the same way on both sides. Buffers travel in float32 or the
parameter's own dtype, as they are: the producer samples with exactly the trainer's weights.
The trainer pushes from a thread (``WeightSender``), so an optimizer step never waits for a
producer that is still generating; pushes arrive in order. A push also carries the sampling
controls that go with those weights (float64 values: the adaptive temperature).
"""

from __future__ import annotations

import datetime
import queue
import secrets
import socket
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

TRAINER, PRODUCER = 0, 1


def trainable(model: nn.Module) -> list[Tensor]:
    """The parameters a push carries, in the module's order (the same on both sides)."""
    return [p for p in model.parameters() if p.requires_grad]


def flatten(params: list[Tensor]) -> Tensor:
    """One detached CPU copy of ``params``, as float32 (every dtype a policy trains in fits)."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


@torch.no_grad()
def unflatten_into(flat: Tensor, params: list[Tensor]) -> None:
    """Copy a pushed buffer into ``params`` in place (cast back to each one's dtype)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"a weight push of {flat.numel()} values for {offset} parameters")


SECRET_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def listener(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` only (torch's store would listen on every interface)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=128)


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return probe.getsockname()[0]


def store(host: str, port: int, is_trainer: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous of the two processes (the trainer's: ``port`` 0 picks a free one)."""
    own = listener(host, port) if is_trainer else None
    return dist.TCPStore(
        host,
        own.getsockname()[1] if own else port,
        2,
        is_trainer,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=own.detach() if own else None,  # the store owns the socket from here
    )


def group(
    rendezvous: dist.TCPStore, rank: int, timeout_s: float, secret: bytes
) -> dist.ProcessGroup:
    """The two processes' gloo group, once the producer has shown the trainer ``secret``
    (``PermissionError`` when the process that joined does not hold it)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    # the trainer listens where its store does; the peer on its address towards the trainer
    host = rendezvous.host if rank == TRAINER else address_towards(rendezvous.host)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    pg = dist.ProcessGroupGloo(rendezvous, rank, 2, options)
    shown = torch.frombuffer(bytearray(secret), dtype=torch.uint8)
    if rank == TRAINER:
        shown = torch.zeros(SECRET_BYTES, dtype=torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = PRODUCER
    pg.broadcast([shown], opts).wait()
    if rank == TRAINER and not secrets.compare_digest(shown.numpy().tobytes(), secret):
        raise PermissionError("a process without the run's secret joined the weights group")
    return pg


def broadcast(pg: dist.ProcessGroup, flat: Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = TRAINER
    pg.broadcast([flat], opts).wait()


class WeightSender:
    """Trainer side: ``push`` snapshots the weights and returns; a thread joins the group
    (``connect``: it waits for the producer) and broadcasts the snapshots in order.
    ``failure`` holds the first error (a producer that died)."""

    def __init__(self, connect: Callable[[], dist.ProcessGroup]) -> None:
        self.connect = connect
        self.pending: queue.Queue[tuple[Tensor, Tensor] | None] = queue.Queue()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._send, name="grpo-weight-sender", daemon=True)
        self.thread.start()

    def push(self, params: list[Tensor], controls: list[float]) -> None:
        self.pending.put((flatten(params), torch.tensor(controls, dtype=torch.float64)))

    def _send(self) -> None:
        try:
            pg = self.connect()
            while (push := self.pending.get()) is not None:
                for tensor in push:
                    broadcast(pg, tensor)
        except BaseException as err:  # the producer is gone; the trainer reads this
            self.failure = err

    def close(self, wait_s: float) -> None:
        """No more pushes: the thread ends within ``wait_s`` (at once when idle), and its group
        is destroyed there before this returns. Left to end by itself, the thread could still
        be inside the group's C++ destructor when the interpreter exits, which aborts the
        process (exit 134 after a finished run). A thread blocked on a live peer stays (a
        daemon); stop the peer first."""
        self.pending.put(None)
        self.thread.join(wait_s)


class WeightReceiver:
    """Producer side: ``receive`` blocks for the next push, loads it into ``params`` and
    returns its ``controls`` values."""

    def __init__(self, pg: dist.ProcessGroup, params: list[Tensor], controls: int) -> None:
        self.pg, self.params = pg, params
        self.buffer = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
        self.controls = torch.empty(controls, dtype=torch.float64)

    def receive(self) -> list[float]:
        broadcast(self.pg, self.buffer)
        broadcast(self.pg, self.controls)
        unflatten_into(self.buffer, self.params)
        return self.controls.tolist()
