"""Helper of the kill -9 tests: ``python kill_at_update.py CONFIG_JSON N [PID_FILE]`` trains
CONFIG and SIGKILLs itself as its N-th update begins (after writing its producer process's pid
to PID_FILE, when it has one), leaving the run as a crash would."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import grpo.training.trainer as trainer_module
from grpo.config import build_config


def main() -> None:
    tree, kill_at = json.loads(sys.argv[1]), int(sys.argv[2])
    pid_file = sys.argv[3] if len(sys.argv) > 3 else None
    update = trainer_module.Trainer.optimize
    seen = 0

    def optimize(self, scored):
        nonlocal seen
        seen += 1
        if seen == kill_at:
            if pid_file:
                with open(pid_file, "w") as f:
                    f.write(str(self.producer.process.pid))
            os.kill(os.getpid(), signal.SIGKILL)
        return update(self, scored)

    trainer_module.Trainer.optimize = optimize
    # on a GPU, deterministic kernels, as the test runs this run is compared with
    torch.use_deterministic_algorithms(torch.cuda.is_available())
    trainer_module.train(build_config(tree))


if __name__ == "__main__":
    main()
