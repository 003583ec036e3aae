"""The arithmetic of benchmarks.speed.rollout_speed: the decode limit, the token comparison of
two rollouts, the product timing and the products' ceiling, on made-up rollouts and tiny
models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from benchmarks.speed import rollout_speed
from grpo.config import RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout import packed_weights
from grpo.step_data import Rollout


def test_the_decode_limit_is_the_slower_of_streaming_and_computing() -> None:
    # 1e6 weights: float32 streams 4e6 bytes (0.4 ms at 1e10 B/s); 8 rows compute 1.6e7 FLOPs
    # (1.6 ms at 1e10 FLOP/s): compute-bound, 8 / 1.6 ms = 5000 tokens/s
    limit = rollout_speed.decode_limit(10**6, 8, bandwidth=1e10, peak=1e10)
    assert limit["stream_s"] == pytest.approx(4e-4)
    assert limit["tokens_per_s"] == pytest.approx(5000)
    # one row at a fast peak is bandwidth-bound, and bf16 streams half the bytes
    assert rollout_speed.decode_limit(10**6, 1, 1e10, 1e15)["tokens_per_s"] == pytest.approx(2500)
    bf16 = rollout_speed.decode_limit(10**6, 1, 1e10, 1e15, bytes_per_weight=2)
    assert bf16["tokens_per_s"] == pytest.approx(5000)


def _rollout(ids: list[list[int]], lengths: list[int], logps: list[list[float]]) -> Rollout:
    ids_t = torch.tensor(ids)
    mask = torch.arange(ids_t.shape[1])[None] < torch.tensor(lengths)[:, None]
    return Rollout(
        prompt_ids=torch.zeros(len(ids), 1, dtype=torch.long),
        prompt_mask=torch.ones(len(ids), 1, dtype=torch.long),
        completion_ids=ids_t,
        completion_mask=mask,
        truncated=torch.zeros(len(ids), dtype=torch.bool),
        prompts=[""] * len(ids),
        completions=[""] * len(ids),
        rows=[{}] * len(ids),
        group_size=1,
        sampler_logp=torch.tensor(logps),
    )


def test_differences_count_completions_and_compare_log_probs_where_tokens_agree() -> None:
    # row 0 the same tokens (padding after the end differs, and is not a token); row 1 differs
    # at its second token; row 2 is longer in one rollout: another completion
    got = _rollout(
        [[1, 2, 9], [1, 3, 0], [4, 0, 0]], [2, 3, 1], [[-1.0, -2.0, 0], [0, 0, 0], [0, 0, 0]]
    )
    want = _rollout(
        [[1, 2, 7], [1, 4, 0], [4, 5, 0]], [2, 3, 2], [[-1.5, -2.25, 5], [0, 0, 0], [0, 0, 0]]
    )
    assert rollout_speed.differences(got, want) == {
        "completions": 3,
        "differing": 2,
        "max_logp_diff_where_same": 0.5,
    }


def test_product_times_cover_every_row_count_and_both_ways(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    names = ("hf_float32", "hf_float32_packed")
    sampling = rollout_speed.variants(model, load_tokenizer(tiny_model_dir), RolloutConfig(), names)
    out = rollout_speed.product_times(sampling, model, rows=(1, 4))
    assert set(out) == {1, 4}
    weights = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    for n, row in out.items():
        assert row["f_linear_gflops"] == pytest.approx(2 * n * weights / row["f_linear_s"] / 1e9)
        assert row["packed_over_f_linear"] == pytest.approx(row["packed_s"] / row["f_linear_s"])


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("hf_float32", torch.float32),
        ("hf_bf16", torch.bfloat16),
        ("hf_bf16_compiled", torch.bfloat16),
    ],
)
def test_the_products_pass_is_every_linear_layer_as_the_variant_multiplies(
    tiny_model_dir: Path, name: str, dtype: torch.dtype
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    built = rollout_speed.variants(model, load_tokenizer(tiny_model_dir), RolloutConfig(), (name,))
    assert list(built) == [name]  # only what is named is built (a vLLM engine would start)
    with pytest.raises(ValueError, match="no variant hf_fp8"):
        rollout_speed.variants(model, load_tokenizer(tiny_model_dir), RolloutConfig(), ("hf_fp8",))
    variant = built[name]
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert layers[-1] is model.lm_head
    inputs = {k: torch.randn(6, k) for k in {m.in_features for m in layers}}
    with torch.no_grad(), rollout_speed.decode_products(variant, model, inputs) as run:
        got = run()
        # the eager bf16 step multiplies on packed weights where oneDNN has the kernels (the
        # same bits as F.linear's, so only the layers' replaced forward tells), the rest as is
        packed = name == "hf_bf16" and packed_weights._kernels(torch.bfloat16)
        assert all(("forward" in vars(m)) == packed for m in layers)
    assert len(got) == len(layers)
    for out, m in zip(got, layers, strict=True):
        # each layer's own product in the variant's dtype: float32 F.linear's bits, or bf16
        # (oneDNN's packed product and F.linear agree to the bit at these widths)
        want = F.linear(inputs[m.in_features].to(dtype), m.weight.detach().to(dtype))
        assert out.dtype == dtype
        assert torch.equal(out, want)
    assert not any("forward" in vars(m) for m in layers)  # the session unpacked them


def test_the_products_ceiling_is_the_rows_over_the_fastest_pass(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(tiny_model_dir)
    variant = rollout_speed.variants(model, tokenizer, RolloutConfig(), ("hf_float32",))
    # three passes of 0.5, 0.2 and 0.4 s: the fastest sets the ceiling, 8 rows / 0.2 s
    clock = iter([0, 0.5, 1, 1.2, 2, 2.4])
    monkeypatch.setattr(rollout_speed.time, "perf_counter", lambda: next(clock))
    ceiling = rollout_speed.products_ceiling(variant["hf_float32"], model, rows=8, repeats=3)
    assert ceiling == {
        "products_s": pytest.approx(0.2),
        "products_ceiling_tokens_per_s": pytest.approx(40),
    }


@pytest.mark.slow
def test_compile_start_measures_a_cold_process_then_warm_ones(tmp_path: Path) -> None:
    from benchmarks.speed import compile_start

    out = tmp_path / "start.json"
    compile_start.main(["--model", "tiny-random", "--warm", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-random"
    assert [p["kernel_cache"] for p in result["processes"]] == ["empty", "filled"]
    # the warm process found the kernels the cold one wrote into the folder the benchmark named
    # (not grpo's own, which the children would use if they dropped the variable)
    cold, warm = (p["kernel_files_before"] for p in result["processes"])
    assert cold == 0 and warm > 0
    for process in result["processes"]:
        assert len(process["rollout_s"]) == 3 and all(t > 0 for t in process["tokens"])
