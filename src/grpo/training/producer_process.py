"""Generation ahead of training (``rollout.max_staleness: k >= 1``): a producer process rolls
out and scores the next steps' prompts while the trainer updates (docs/ahead.md).

The schedule is fixed by step index, never by timing: step t trains on groups sampled with the
weights after step ``sampling_version(t, k)`` = t-1-k (the first weights for the first steps),
so two runs with the same seed compute the same thing however fast either process is. The
producer is the synchronous run's ``InProcessProducer`` in a second process (spawned: a fresh
interpreter, its own share of the cores); the trainer pushes its weights after every step
(``grpo.runtime.weight_sync``) and receives whole steps (``Produced``) over a queue.

A checkpoint after step t holds the steps the producer had already made (t+1 ... at least
t+k, sampled with weights no checkpoint keeps) and the producer's state after the newest of
them, so a resumed run continues with the very same rollouts. A producer that exits, fails or
sends nothing for ``rollout.producer_timeout_s`` stops the run with a checkpoint
(``ProducerLost``); a resume from it generates what it lacked with the resumed weights, and says
so.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.multiprocessing as mp
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from grpo import build
from grpo.config import Config
from grpo.rollout import RolloutLost
from grpo.runtime import weight_sync
from grpo.runtime.distributed import DistInfo
from grpo.runtime.host_memory import bound_kernel_caches
from grpo.training.producer import Ahead, InProcessProducer, ProducedStep
from grpo.training.temperature import TemperatureController

HOST = "127.0.0.1"
CONTROLS = ("temperature",)  # what a weight push carries besides the weights
WAIT_FOR_TRAINER_S = 7 * 24 * 3600.0
CLOSE_WAIT_S = 10.0  # for the producer, then the weight sender's thread, to end


def sampling_version(step: int, staleness: int, first: int = 0) -> int:
    """The weights (optimizer steps applied) that sample step ``step``'s (1-based) groups when
    rollouts may be ``staleness`` steps old; ``first``: the oldest weights there are (a run
    resumed after step ``first`` has no older ones)."""
    return max(first, step - 1 - staleness)


def producer_device(trainer: torch.device) -> torch.device:
    """The producer's device: the GPU after the trainer's when there is one, else the
    trainer's (a CPU, or one GPU shared)."""
    if trainer.type != "cuda":
        return trainer
    following = (trainer.index or 0) + 1
    return torch.device("cuda", following) if following < torch.cuda.device_count() else trainer


def split_threads(total: int, producer: int | None) -> tuple[int, int]:
    """(trainer, producer) threads out of ``total``: the producer's as asked, else half."""
    ours = producer or max(1, total // 2)
    return max(1, total - ours), ours


class ProducerLost(RolloutLost):
    """The producer process died, failed or stopped answering; the run stopped."""


@dataclass
class Produced:
    """One step's groups, as the producer made them (sent over the queue; a checkpoint's
    ``ahead`` holds those not trained on yet).

    version: the weights they were sampled with (optimizer steps applied); made: the groups,
    their temperature, seconds and skips; wait_train_s: the producer's wait for those weights;
    state: the producer's checkpoint state right after this step.
    """

    step: int
    version: int
    made: ProducedStep
    wait_train_s: float
    state: dict[str, Any]

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "clock" in state:  # pickled in a checkpoint before ProducedStep: a dict of its values
            clock = state.pop("clock")
            state["made"] = ProducedStep(
                state.pop("collected"),
                clock["temperature"],
                clock["rollout"],
                clock["reward"],
                clock["skipped"],
            )
            state["wait_train_s"] = clock["wait_train"]
        self.__dict__.update(state)


@dataclass
class ProducerSpec:
    """What the producer process builds its stack from (pickled to it at spawn)."""

    config: Config
    rows: list[dict[str, Any]]
    rewards: dict[str, Any]  # given reward callables, by spec name
    environment: Callable[[], Any] | None  # a given class or factory (pickled by reference)
    model_path: str | None  # loaded as the trainer loaded it; else ``policy`` is a copy
    policy: nn.Module | None
    tokenizer: PreTrainedTokenizerBase | None
    state: dict[str, Any] | None  # the Producer's state to start from
    first_step: int
    first_version: int
    threads: int
    device: torch.device
    deterministic: bool  # the trainer's torch.use_deterministic_algorithms, for the same sums
    port: int
    secret: bytes  # shown to the trainer when joining the weights group
    parent: int


# ------------------------------------------------------------------------- producer process


def produce(spec: ProducerSpec, out: Any) -> None:
    """The producer process: build the stack, then make steps first_step ... train.steps."""
    # Ctrl-C reaches the whole process group: the trainer decides when to stop, and stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_exit_with_parent, args=(spec.parent,), daemon=True).start()
    try:
        _produce(spec, out)
    except BaseException as err:
        said = " ".join(str(err).split())[:300] or type(err).__name__
        out.put(f"{type(err).__name__}: {said}")


def _exit_with_parent(parent: int) -> None:
    # a trainer killed with SIGKILL cannot stop us: go when it is gone
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _produce(spec: ProducerSpec, out: Any) -> None:
    config, timeout = spec.config, spec.config.rollout.producer_timeout_s
    bound_kernel_caches()
    torch.set_num_threads(spec.threads)
    torch.use_deterministic_algorithms(spec.deterministic)
    hf_logging.disable_progress_bar()  # the trainer already showed its model loading
    producer = None
    # the environment's class is imported here again (or unpickled: a given one by reference)
    environment = build.environment_of(config, spec.environment)
    fmt = build.prompt_format(config, environment)
    rewards = build.reward_runner(config, None, spec.rewards, environment)
    try:
        if spec.policy is not None:
            tokenizer, policy = spec.tokenizer, spec.policy.to(spec.device)
        else:
            tokenizer, policy = build.load_model(
                config.model, spec.model_path, fmt, spec.rows, spec.device
            )
        policy.train()  # as the trainer's policy samples
        engine = build.engine_of(config, policy, tokenizer, None, environment)
        here = DistInfo(device=spec.device)
        producer = InProcessProducer(
            config, here, spec.rows, fmt, tokenizer, policy, engine, rewards
        )
        if spec.state is not None:
            producer.load_state_dict(spec.state)
        rendezvous = weight_sync.store(HOST, spec.port, False, timeout)
        # the trainer may take long (an evaluation) before the weights we wait for: no limit
        # of ours; a trainer that died ends this process (_exit_with_parent)
        pg = weight_sync.group(rendezvous, weight_sync.PRODUCER, WAIT_FOR_TRAINER_S, spec.secret)
        weights = weight_sync.WeightReceiver(pg, weight_sync.trainable(policy), len(CONTROLS))
        # the trainer's weights now (version first_version), and the temperature after them
        controls = weights.receive()
        producer.engine.sync_weights(policy)
        held = spec.first_version
        for step in range(spec.first_step, config.train.steps + 1):
            t0 = time.perf_counter()
            needed = sampling_version(step, config.rollout.max_staleness, spec.first_version)
            if held < needed:
                while held < needed:
                    controls = weights.receive()
                    held += 1
                producer.engine.sync_weights(policy)
            # adaptive: the temperature the trainer had set after the step of these weights
            producer.temperature.current = controls[CONTROLS.index("temperature")]
            wait_train_s = time.perf_counter() - t0
            made = producer.collect(step)
            # plain pickle: torch's queue would share tensors through this process's memory,
            # which must then outlive the trainer's reading them
            out.put(pickle.dumps(Produced(step, held, made, wait_train_s, producer.state_dict())))
    finally:
        if producer is not None:
            producer.close()
        rewards.close()


def _produced(message: Any) -> Produced | None:
    """A step the producer sent, or None for bytes that are none."""
    if not isinstance(message, bytes):
        return None
    try:
        produced = pickle.loads(message)
    # unpickling garbage raises whatever the bytes lead it to (pickle names no closed set)
    except Exception:
        return None
    return produced if isinstance(produced, Produced) else None


# ------------------------------------------------------------------------- trainer's side


class ProducerProcess:
    """The trainer's handle on the producer process: a ``Producer`` whose groups are made ahead
    in another process."""

    def __init__(
        self,
        config: Config,
        rows: list[dict[str, Any]],
        rewards: dict[str, Any],
        model_path: str | None,
        policy: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        environment: Callable[[], Any] | None = None,
    ) -> None:
        self.config, self.rows, self.rewards = config, rows, rewards
        self.environment = environment
        self.model_path, self.policy, self.tokenizer = model_path, policy, tokenizer
        self.device = device  # the trainer's
        self.staleness = config.rollout.max_staleness
        self.timeout_s = config.rollout.producer_timeout_s  # from its start: loading counts
        # adaptive: the trainer observes each step and pushes the temperature with the weights
        self.temperature = TemperatureController(config)
        self.curriculum = None  # data.curriculum needs max_staleness 0 (grpo.config.resolution)
        self.ready: dict[int, Produced] = {}  # steps made and not yet trained on
        self.state: dict[str, Any] | None = None  # the producer's, after its newest step
        self.process: Any = None
        self.sender: weight_sync.WeightSender | None = None
        self.consumed_step = 0
        self.lost: str | None = None
        self.threads = torch.get_num_threads()
        self.spec: ProducerSpec | None = None

    # --------------------------------------------------------------- life

    def _start(self, version: int) -> None:
        """Spawn the producer; it samples from the current weights (``version``) first."""
        rollout = self.config.rollout
        trainer_threads, producer_threads = split_threads(self.threads, rollout.producer_threads)
        made = max(self.ready, default=version)
        short = min(version + self.staleness, self.config.train.steps)
        if self.state is not None and made < short:  # resumed from a lost producer, or k = 0
            print(
                f"grpo: the checkpoint holds no rollouts made ahead for steps {made + 1}-{short}: "
                "they are sampled with the resumed weights (staleness below max_staleness)",
                file=sys.stderr,
                flush=True,
            )
        rendezvous = weight_sync.store(HOST, 0, True, rollout.producer_timeout_s)
        given_model = self.model_path is None
        spec = ProducerSpec(
            config=self.config,
            rows=self.rows,
            rewards=self.rewards,
            environment=self.environment,
            model_path=self.model_path,
            # a given model travels as a copy (on the host): a pickled tensor would share the
            # trainer's memory
            policy=copy.deepcopy(self.policy).cpu() if given_model else None,
            tokenizer=self.tokenizer if given_model else None,
            state=self.state,
            first_step=made + 1,
            first_version=version,
            threads=producer_threads,
            device=producer_device(self.device),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            port=rendezvous.port,
            secret=weight_sync.new_secret(),
            parent=os.getpid(),
        )
        context = mp.get_context("spawn")
        self.queue = context.Queue()
        # not a daemon: the producer starts reward and sandbox processes of its own
        self.process = context.Process(
            target=produce, args=(spec, self.queue), name="grpo-producer"
        )
        try:
            self.process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as err:  # a given part
            raise ProducerLost(
                f"rollout.max_staleness: the producer process cannot receive this run's parts "
                f"({' '.join(str(err).split())[:200]}); reward functions, environment classes and "
                "datasets must be importable (module:name), not defined in a notebook"
            ) from None
        self.spec = spec  # its shared tensors live until the producer has read them
        self.rendezvous = rendezvous
        torch.set_num_threads(trainer_threads)
        # a producer that takes no weights is seen hung by _receive first (producer_timeout_s)
        limit = 2 * rollout.producer_timeout_s
        self.sender = weight_sync.WeightSender(
            lambda: weight_sync.group(rendezvous, weight_sync.TRAINER, limit, spec.secret)
        )
        self._push()

    def _push(self) -> None:
        assert self.sender is not None
        self.sender.push(weight_sync.trainable(self.policy), [self.temperature.current])

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            # SIGTERM's default is as abrupt, and a stopped (SIGSTOP) producer takes only SIGKILL
            self.process.kill()
            self.process.join(CLOSE_WAIT_S)
        if self.sender is not None:  # after the producer: a push it never took fails at once
            self.sender.close(CLOSE_WAIT_S)
        torch.set_num_threads(self.threads)

    # --------------------------------------------------------------- the producer's interface

    def collect(self, step: int) -> ProducedStep:
        """Step ``step``'s groups, with their staleness and the waits (``Ahead``)."""
        if self.process is None:
            self._start(step - 1)
        t0 = time.perf_counter()
        while step not in self.ready:
            self._receive()
        produced = self.ready.pop(step)
        collected = produced.made.collected
        for batch in (collected.seen, collected.train):
            if batch is not None:  # every rollout carries the weights that sampled it
                batch.rollout.policy_version = produced.version
        ahead = Ahead(
            staleness=float(step - 1 - produced.version),
            wait_rollout_s=time.perf_counter() - t0,
            wait_train_s=produced.wait_train_s,
        )
        self.consumed_step = step
        return dataclasses.replace(produced.made, ahead=ahead)

    def sync_weights(self, step: int, changed: bool) -> None:
        """After step ``step``: push its weights when a later step samples with them."""
        if self.sender is None:
            return  # not started: the start pushes the weights it starts from
        if step + 1 + self.staleness <= self.config.train.steps:
            self._push()

    def state_dict(self) -> dict[str, Any]:
        """The producer's state after its newest step, and the steps made ahead (all of them up
        to ``consumed + k`` unless the producer is lost)."""
        if self.process is not None and self.lost is None:
            last = min(self.consumed_step + self.staleness, self.config.train.steps)
            try:
                while any(s not in self.ready for s in range(self.consumed_step + 1, last + 1)):
                    self._receive()
            except ProducerLost as lost:  # the checkpoint is still whole: a resume regenerates
                made = max(self.ready, default=self.consumed_step)
                print(
                    f"grpo: {lost}: this checkpoint holds the rollouts made ahead up to step "
                    f"{made}, not to {last}",
                    file=sys.stderr,
                    flush=True,
                )
        if self.state is None:
            raise ProducerLost("the producer made no step yet: no state to save")
        return {
            **self.state,
            "temperature": self.temperature.state_dict(),  # the trainer's: it observes the steps
            "ahead": [self.ready[s] for s in sorted(self.ready)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ready = {p.step: p for p in state.get("ahead", [])}
        self.state = {k: v for k, v in state.items() if k in ("consumed", "greso", "temperature")}
        if self.ready:
            self.state = self.ready[max(self.ready)].state
        self.consumed_step = int(state["step"])
        if state.get("temperature"):
            self.temperature.load_state_dict(state["temperature"])

    # --------------------------------------------------------------- the queue

    def _receive(self) -> None:
        """One message from the producer, or ProducerLost after one line saying why."""
        if self.lost is not None:  # found lost while saving: no second wait
            raise ProducerLost(self.lost)
        timeout = self.timeout_s
        t0 = time.perf_counter()
        while True:
            try:
                message = self.queue.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    why = f"exited with code {self.process.exitcode}"
                elif self.sender is not None and isinstance(self.sender.failure, PermissionError):
                    why = f"was not the one that joined the weights group: {self.sender.failure}"
                elif self.sender is not None and self.sender.failure is not None:
                    # gloo's own words name a socket, not the side: ours say which
                    why = "stopped taking the trainer's weights (their connection broke or "
                    why += "waited 2 x rollout.producer_timeout_s)"
                elif time.perf_counter() - t0 > timeout:
                    why = f"sent nothing for {timeout:.0f} s (rollout.producer_timeout_s)"
                else:
                    continue
                self._lose(why)
        if isinstance(message, str):  # the producer's own error, in one line
            self._lose(f"failed: {message}")
        produced = _produced(message)
        if produced is None:
            self._lose("sent a message that is not a step (garbage on its queue)")
        self.ready[produced.step] = produced
        self.state = produced.state
        self.spec = None  # the producer has built its stack: a given model's copy can go

    def _lose(self, why: str) -> NoReturn:
        self.lost = f"the producer process {' '.join(why.split())[:400]}"
        raise ProducerLost(self.lost)
