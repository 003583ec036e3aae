"""The weights group's edges: the trainer's store listens on its own address only, a process
that joins without the run's secret receives no weights, and a closed sender has ended its
thread and group before ``close`` returns."""

from __future__ import annotations

import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

from grpo.runtime import weight_sync


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_the_trainers_store_listens_on_the_given_address_only() -> None:
    own = weight_sync.store("127.0.0.1", 0, True, 5)
    assert connects("127.0.0.1", own.port)
    # 127.0.0.2 reaches this machine too: torch's own store (every interface) answers there
    assert not connects("127.0.0.2", own.port)
    everywhere = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    assert connects("127.0.0.2", everywhere.port)


def join_both(trainer_secret: bytes, peer_secret: bytes) -> dict[int, Any]:
    """Both sides of a group on loopback, each on a thread: rank -> its group or its error."""
    rendezvous = weight_sync.store("127.0.0.1", 0, True, 10)
    peer_store = weight_sync.store("127.0.0.1", rendezvous.port, False, 10)
    out: dict[int, Any] = {}

    def join(rank: int, store: dist.TCPStore, secret: bytes) -> None:
        try:
            out[rank] = weight_sync.group(store, rank, 10, secret)
        except Exception as err:
            out[rank] = err

    threads = [
        threading.Thread(target=join, args=(weight_sync.TRAINER, rendezvous, trainer_secret)),
        threading.Thread(target=join, args=(weight_sync.PRODUCER, peer_store, peer_secret)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return out


def test_the_peer_with_the_secret_joins_and_receives_the_weights() -> None:
    secret = weight_sync.new_secret()
    groups = join_both(secret, secret)
    assert all(isinstance(pg, dist.ProcessGroupGloo) for pg in groups.values()), groups
    sent, got = torch.arange(5, dtype=torch.float32), torch.zeros(5)
    thread = threading.Thread(target=weight_sync.broadcast, args=(groups[0], sent))
    thread.start()
    weight_sync.broadcast(groups[1], got)
    thread.join(10)
    assert torch.equal(got, sent)


def test_a_peer_without_the_secret_is_refused_before_any_push() -> None:
    groups = join_both(weight_sync.new_secret(), weight_sync.new_secret())
    assert isinstance(groups[weight_sync.TRAINER], PermissionError)
    assert "without the run's secret" in str(groups[weight_sync.TRAINER])


def test_the_peer_listens_on_its_address_towards_the_trainer() -> None:
    assert weight_sync.address_towards("127.0.0.1") == "127.0.0.1"
    assert weight_sync.address_towards("127.0.0.2") == "127.0.0.1"  # the loopback's own


def test_a_closed_sender_has_ended_its_thread_and_group() -> None:
    # the producer's rank in a thread of this process: the same group as across two processes
    rendezvous = weight_sync.store("127.0.0.1", 0, True, 30)
    secret = weight_sync.new_secret()
    got: list[list[float]] = []
    target = [torch.zeros(5)]

    def producer() -> None:
        peer = weight_sync.store("127.0.0.1", rendezvous.port, False, 30)
        pg = weight_sync.group(peer, weight_sync.PRODUCER, 30, secret)
        got.append(weight_sync.WeightReceiver(pg, target, 1).receive())

    receiver = threading.Thread(target=producer)
    receiver.start()
    sender = weight_sync.WeightSender(
        lambda: weight_sync.group(rendezvous, weight_sync.TRAINER, 30, secret)
    )
    sender.push([torch.arange(5.0)], [0.5])
    receiver.join(30)
    assert got == [[0.5]] and torch.equal(target[0], torch.arange(5.0))
    sender.close(10)
    # a thread still inside the group's C++ destructor when Python exits aborts the process
    # (exit 134 after "run finished"): close waits for it
    assert not sender.thread.is_alive() and sender.failure is None
