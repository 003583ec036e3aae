"""The weights group's edges: the trainer's store listens on its own address only, and a process
that joins without the run's secret receives no weights."""

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
