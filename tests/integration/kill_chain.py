"""Helper of tests/integration/test_resume.py: train one run through a chain of SIGKILLs.

``python tests/integration/kill_chain.py CONFIG_JSON SEED`` imports the trainer once and forks a child per
life. The first child trains the run uninterrupted (run "straight") and counts its events: every
disk event (fsync, rename, replace, torch.save) and step phase (rollout and rewards, update,
metrics logged), each before and after. Then children in turn resume the run "chain"
(train.resume=auto), each SIGKILLing itself at its k-th event, k drawn at random up to the events
of about one and a half steps, until one lives to the end. Forking after the imports keeps each
life cheap; the parent runs no torch code, so every child starts from the same clean state.
Prints one JSON line per life; kills.log names the event each life died at.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def arm(kill_at: int, log: Path) -> Callable[[], int]:
    """Make the kill_at-th event of this process its last (its name goes to ``log`` first);
    returns a function giving the number of events so far."""
    import torch

    import grpo.training.producer
    import grpo.training.trainer
    from grpo.runs.metrics import MetricsLogger

    count = 0

    def event(name: str) -> None:
        nonlocal count
        count += 1
        if count == kill_at:
            with log.open("a") as f:
                f.write(f"{kill_at} {name}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def around(owner: Any, name: str) -> None:
        original: Callable = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            event(f"before {name}")
            out = original(*args, **kwargs)
            event(f"after {name}")
            return out

        setattr(owner, name, wrapped)

    for name in ("fsync", "rename", "replace"):
        around(os, name)
    around(torch, "save")
    around(grpo.training.producer.InProcessProducer, "collect")  # rollout + rewards of a step
    around(grpo.training.trainer.Trainer, "optimize")  # the update: weights move, not yet saved
    around(MetricsLogger, "log")
    return lambda: count


def life(config: Any, kill_at: int, log: Path) -> dict[str, Any]:
    """One child process training ``config``: how it ended, and how many events it saw."""
    pid = os.fork()
    if pid == 0:
        from grpo.training.trainer import train

        events = arm(kill_at, log)
        code = 0
        try:
            train(config)
            (log.parent / "events").write_text(str(events()))
        except BaseException as err:  # reported to the parent through the exit status
            print(f"life failed: {err!r}", file=sys.stderr, flush=True)
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    out = {"kill_at": kill_at, "killed": killed, "exit": os.waitstatus_to_exitcode(status)}
    if not killed and out["exit"] == 0:
        out["events"] = int((log.parent / "events").read_text())
    return out


def warm_imports(model: str) -> None:
    """Import what every life needs once, here: transformers imports most modules on first use
    (~7 s a life otherwise). Loading a config and a tokenizer runs no torch code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.models import load_tokenizer

    config = AutoConfig.from_pretrained(model)
    AutoModelForCausalLM._model_mapping[type(config)]  # imports the modeling module
    load_tokenizer(model)


def main() -> None:
    from grpo.config import build_config

    tree, seed = json.loads(sys.argv[1]), int(sys.argv[2])
    warm_imports(tree["model"]["name"])
    log = Path(tree["train"]["output_dir"]) / "kills.log"
    log.parent.mkdir(parents=True, exist_ok=True)

    def config(run_name: str) -> Any:
        return build_config({**tree, "train": {**tree["train"], "run_name": run_name}})

    straight = life(config("straight"), 0, log)
    print(json.dumps(straight), flush=True)
    window = 3 * straight["events"] // (2 * tree["train"]["steps"])
    rng = random.Random(seed)
    for _ in range(50):  # ends much sooner: each life has a fair chance to finish a step
        result = life(config("chain"), rng.randint(1, window), log)
        print(json.dumps(result), flush=True)
        if not result["killed"]:
            break


if __name__ == "__main__":
    import grpo.training.trainer  # noqa: F401  (the imports every child shares)

    main()
