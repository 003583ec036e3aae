"""The trainer's weight sender (grpo.runtime.weight_sync) over a real two-rank gloo group: a
closed sender's thread has ended, its group destroyed, before ``close`` returns."""

from __future__ import annotations

import threading

import torch

from grpo.runtime import weight_sync


def test_a_closed_sender_has_ended_its_thread_and_group() -> None:
    # the producer's rank in a thread of this process: the same group as across two processes
    rendezvous = weight_sync.store("127.0.0.1", 0, True, 30)
    got: list[list[float]] = []
    target = [torch.zeros(5)]

    def producer() -> None:
        peer = weight_sync.store("127.0.0.1", rendezvous.port, False, 30)
        pg = weight_sync.group(peer, weight_sync.PRODUCER, 30)
        got.append(weight_sync.WeightReceiver(pg, target, 1).receive())

    receiver = threading.Thread(target=producer)
    receiver.start()
    sender = weight_sync.WeightSender(
        lambda: weight_sync.group(rendezvous, weight_sync.TRAINER, 30)
    )
    sender.push([torch.arange(5.0)], [0.5])
    receiver.join(30)
    assert got == [[0.5]] and torch.equal(target[0], torch.arange(5.0))
    sender.close(10)
    # a thread still inside the group's C++ destructor when Python exits aborts the process
    # (exit 134 after "run finished"): close waits for it
    assert not sender.thread.is_alive() and sender.failure is None
