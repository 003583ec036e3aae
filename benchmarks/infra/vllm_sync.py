"""Do pushed weights reach vLLM? Log-probs of vLLM's samples from vLLM and from the trainer.

Trains SmolLM2 with the default recipe's task and rewards through ``rollout.engine=vllm`` (a
smaller batch, a larger learning rate, so the weights move in few steps). After 1, 5 and 20
optimizer steps it rolls out fixed probe prompts with vLLM and scores the same tokens with the
trainer's policy and with the untouched base model: vLLM must agree with the policy (the
mismatch is numerical noise) and differ from the base (the push changed what vLLM samples).
``--lora`` does the same with a LoRA policy, pushed merged.

    .venv/bin/python -m benchmarks.infra.vllm_sync [--lora]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from grpo.config import dump_config, load_config
from grpo.models import resolve_model_path
from grpo.scoring.logprobs import completion_logprobs
from grpo.training.resume import open_run
from grpo.training.trainer import Trainer


def gaps(model: torch.nn.Module, rollout, sampler_logp: torch.Tensor) -> dict[str, float]:
    """Mean and max |model - vLLM| log-prob over the counted tokens."""
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model,
            rollout.prompt_ids,
            rollout.prompt_mask,
            rollout.completion_ids,
            rollout.completion_mask,
            rollout.decoding,
        )
    diff = (logp - sampler_logp).abs()[rollout.completion_mask]
    return {"mean": float(diff.mean()), "max": float(diff.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", default="1,5,20")
    args = parser.parse_args()
    checkpoints = [int(s) for s in args.steps.split(",")]
    name = "lora" if args.lora else "full"
    out_dir = tempfile.mkdtemp(prefix="vllm-sync-")
    overrides = [
        "rollout.engine=vllm",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=24",
        "train.eval_every=0",
        "train.save_every=0",
        f"train.steps={max(checkpoints)}",
        f"train.output_dir={out_dir}",
        f"train.run_name={name}",
        "train.progress=false",
    ]
    overrides += ["model.lora.enabled=true", "optim.lr=2e-4"] if args.lora else ["optim.lr=2e-5"]
    config = load_config(None, overrides)
    trainer = Trainer(config)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(config.model.name)).eval()
    probe = trainer.rows[-4:]
    prompts = [trainer.prompt_format.render(trainer.tokenizer, r) for r in probe]
    open_run(trainer.run, trainer.plan, dump_config(trainer.config))
    results = []
    try:
        while trainer.state.step < max(checkpoints):
            trainer.state.step += 1
            metrics = trainer.train_step()
            if trainer.state.step in checkpoints:
                rollout = trainer.producer.engine.generate(prompts, probe, 4, seeds=[1, 2, 3, 4])
                entry = {
                    "step": trainer.state.step,
                    "tokens": int(rollout.completion_mask.sum()),
                    "vllm_vs_trainer": gaps(trainer.state.policy, rollout, rollout.sampler_logp),
                    "vllm_vs_base": gaps(base, rollout, rollout.sampler_logp),
                    "train_tis_mismatch_mean": metrics.get("tis/mismatch_mean"),
                }
                results.append(entry)
                print(json.dumps(entry), flush=True)
    finally:
        trainer.producer.rewards.close()
        trainer.run.release()
    path = Path(f"benchmarks/results/vllm_sync_{name}_smollm2.json")
    path.write_text(json.dumps({"overrides": overrides, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
