"""What verified checkpoints cost on SmolLM2-135M: a checkpoint's write (HF folder + optimizer
state), then its seal (fsync + sha256 of every file, manifest last, rename), and the verify a
resume does (re-read + sha256 of every file), over a few rounds in one process.

    python -m benchmarks.infra.checkpoint [--rounds 3]

The files are fresh in the page cache, as they are right after a save; a resume after a reboot
reads them from the disk instead. JSON to benchmarks/results/checkpoint_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import grpo.runs.directory
from grpo.config import build_config
from grpo.runs.directory import verify
from grpo.training.trainer import Trainer

RESULTS = Path(__file__).resolve().parents[1] / "results" / "checkpoint_smollm2.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="grpo-ckpt-bench-"))
    config = build_config(
        {
            "model": {"name": "smollm2-135m-instruct"},
            "algorithm": {"beta": 0.0},
            "train": {"output_dir": str(out_dir), "run_name": "bench", "resume": "never"},
        }
    )
    trainer = Trainer(config)
    # fill AdamW's state (two moments per weight) as a real step would
    for p in trainer.state.policy.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    trainer.state.optimizer.step()

    sealing: list[float] = []
    original = grpo.runs.directory.seal

    def timed_seal(folder: Path, meta: dict) -> None:
        t0 = time.perf_counter()
        original(folder, meta)
        sealing.append(time.perf_counter() - t0)

    grpo.runs.directory.seal = timed_seal
    rounds = []
    for step in range(1, args.rounds + 1):
        trainer.state.step = step
        t0 = time.perf_counter()
        trainer.save()
        total = time.perf_counter() - t0
        folder = trainer.run.checkpoints / f"step-{step}"
        t1 = time.perf_counter()
        assert verify(folder) is None
        verified = time.perf_counter() - t1
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        rounds.append(
            {
                "bytes": size,
                "save_s": total,
                "seal_s": sealing[-1],
                "write_s": total - sealing[-1],
                "verify_s": verified,
            }
        )
        print(json.dumps(rounds[-1]))
    trainer.run.release()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    summary = {
        "command": f"python -m benchmarks.infra.checkpoint --rounds {args.rounds}",
        "model": "smollm2-135m-instruct (float32) + AdamW state",
        "checkpoint_mb": rounds[0]["bytes"] / 2**20,
        "median_write_s": median("write_s"),
        "median_seal_s": median("seal_s"),
        "median_verify_s": median("verify_s"),
        "seal_over_write": median("seal_s") / median("write_s"),
        "rounds": rounds,
    }
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
