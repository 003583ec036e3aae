"""The lean decode step: the model's own decode forward, bit for bit, without its glue."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grpo.config import ModelConfig, RolloutConfig
from grpo.models import load_policy, load_tokenizer
from grpo.rollout import decode, kv_cache
from grpo.rollout.hf import HFEngine
from grpo.rollout.kv_cache import reserved_cache
from grpo.scoring.prefix_attention import use_prefix_attention

SMALL = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def qwen2(**overrides) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, **overrides)).eval()  # q, k, v with biases


def qwen3(**overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=8, **overrides)).eval()  # head norms


def mistral(**overrides) -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(**SMALL, **{"sliding_window": None, **overrides})
    return MistralForCausalLM(config).eval()


def llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, **overrides)).eval()


def decode_both(
    model, steps: int = 6, caches: tuple = (reserved_cache, reserved_cache), lean: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Left-padded prompts prefilled once per path, then ``steps`` decode steps through the
    model's own forward and through lean_step (or with ``lean=False`` its own forward again),
    each on its own cache (``caches``: the two paths' cache builders): their logits per step."""
    ids = torch.randint(0, 50, (3, 7)).to(model.device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # rows of different prompt lengths
    mask[1, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    paths = []
    second = decode.lean_step(model) if lean else decode.own_step(model)
    for step, make in zip((decode.own_step(model), second), caches, strict=True):
        cache = make(model, 20)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{decode.CACHE_ARG: cache},
            use_cache=True,
        )
        token, grown, at = out.logits[:, -1].argmax(-1), mask, positions[:, -1:]
        logits = []
        for _ in range(steps):
            grown = torch.cat([grown, grown.new_ones(3, 1)], dim=1)
            at = at + 1
            logits.append(step(token, grown, at, cache))
            token = logits[-1].argmax(-1)
        paths.append(logits)
    return list(zip(*paths, strict=True))


@pytest.mark.device
@pytest.mark.parametrize("build", [llama, mistral, qwen2, qwen3])
@pytest.mark.parametrize("attention", ["sdpa", "prefix", "eager"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
def test_lean_step_gives_the_models_own_logits_bit_for_bit(build, attention, bf16, device) -> None:
    model = build(attn_implementation="eager" if attention == "eager" else "sdpa").to(device)
    if attention == "prefix":
        assert use_prefix_attention(model)  # what the trainer's models run
    assert decode.leanable(model)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        pairs = decode_both(model)
    assert all(torch.equal(own, lean) for own, lean in pairs)
    assert not torch.equal(pairs[0][0], pairs[1][0])  # the steps did move on


def transformers_cache(model, _: int) -> DynamicCache:
    return DynamicCache(config=model.config)


@pytest.mark.device
@pytest.mark.parametrize("build", [llama, qwen3])
@pytest.mark.parametrize("attention", ["sdpa", "prefix", "eager"])
def test_the_reserved_cache_holds_bf16_keys_under_autocast_and_changes_no_logit(
    build, attention, device
) -> None:
    # attention casts the float32 keys the rotary embedding gives to bf16 anyway: stored so,
    # each is cast once, and every step's logits are those on transformers' float32 cache
    model = build(attn_implementation="eager" if attention == "eager" else "sdpa").to(device)
    if attention == "prefix":
        assert use_prefix_attention(model)
    ids = torch.ones(2, 3, dtype=torch.long, device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        pairs = decode_both(model, caches=(transformers_cache, reserved_cache), lean=False)
        cache, theirs = reserved_cache(model, 4), transformers_cache(model, 4)
        for held in (cache, theirs):
            model(input_ids=ids, **{decode.CACHE_ARG: held})
    assert all(torch.equal(theirs, ours) for theirs, ours in pairs)
    assert {cache.layers[0].keys.dtype, cache.layers[0].values.dtype} == {torch.bfloat16}
    assert theirs.layers[0].keys.dtype == torch.float32  # what the comparison is against
    with torch.no_grad():  # no autocast: the keys as they come
        cache = reserved_cache(model, 4)
        model(
            input_ids=torch.ones(2, 3, dtype=torch.long, device=device), **{decode.CACHE_ARG: cache}
        )
    assert cache.layers[0].keys.dtype == torch.float32


def test_an_attention_autocast_may_not_cast_keeps_the_keys_as_they_come() -> None:
    # flex attention and other kernels may multiply in what they are given: nothing is narrowed
    model = llama()
    model.config._attn_implementation = "flex_attention"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kv_cache.attended_dtype(model) is None
    model.config._attn_implementation = "sdpa"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kv_cache.attended_dtype(model) == torch.bfloat16
    assert kv_cache.attended_dtype(model) is None
    # another model's eager attention may turn autocast off and upcast its keys; custom code
    # (trust_remote_code) under a transformers class name may do anything
    gpt2 = AutoModelForCausalLM.from_config(
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kv_cache.attended_dtype(gpt2) is None
    model.__class__ = type("LlamaForCausalLM", (LlamaForCausalLM,), {"__module__": "remote.x"})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kv_cache.attended_dtype(model) is None


def test_lean_step_follows_the_models_weights() -> None:
    # it reads the modules, not a copy: a changed weight changes its logits as the model's
    model = llama()
    with torch.no_grad():
        before = decode_both(model, steps=1)[0][1]
        model.model.layers[1].mlp.down_proj.weight.mul_(2)
        own, lean = decode_both(model, steps=1)[0]
    assert torch.equal(own, lean) and not torch.equal(lean, before)


def test_models_lean_step_does_not_mirror_keep_their_own_forward() -> None:
    hooked = llama()
    hooked.model.layers[0].self_attn.register_forward_hook(lambda *a: None)
    replaced = llama()
    layer = replaced.model.layers[1]
    layer.forward = layer.forward  # an instance forward, as accelerate's hooks set
    checkpointed = llama().train()
    checkpointed.gradient_checkpointing_enable()
    for model in (
        hooked,
        replaced,
        checkpointed,
        qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0),
        qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=0),
        mistral(sliding_window=4),
        torch.nn.Linear(2, 2),
    ):
        assert not decode.leanable(model)
    assert all(decode.leanable(build()) for build in (llama, mistral, qwen2, qwen3))


def lora_policy(path) -> torch.nn.Module:
    # the trainer's LoRA policy (PEFT's wrapper, checkpointing's input hook) with adapters that
    # change the logits (lora_B starts at 0)
    policy = load_policy(ModelConfig(lora={"enabled": True, "r": 4}), str(path))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return policy.eval()


@pytest.fixture(params=["full", "lora"])
def engine(request, tiny_model_dir):
    if request.param == "lora":
        model = lora_policy(tiny_model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = load_tokenizer(str(tiny_model_dir))
    return HFEngine(model, tokenizer, RolloutConfig(max_new_tokens=12))


def sample(engine):
    return engine.generate(["a", "a much longer prompt", "bc"], [{}] * 3, 4, seeds=[1, 2, 3])


def test_a_rollout_decodes_lean_after_one_checked_step(engine, monkeypatch) -> None:
    # the first decode step runs both paths and compares; every later one is lean alone. The
    # tokens and sampler log-probs equal a rollout through the model's own forward
    calls = []
    forward = type(engine.model).forward

    def counted(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(engine.model), "forward", counted)
    lean = sample(engine)
    assert decode._VERIFIED[engine.model] is True
    assert calls.count(1) == 1  # the prefill (several tokens) and the one checked step
    calls.clear()
    again = sample(engine)
    assert calls.count(1) == 0
    with monkeypatch.context() as patch:
        patch.setattr(decode, "leanable", lambda model: False)
        own = sample(engine)
    assert calls.count(1) > 1
    for got in (lean, again):
        assert torch.equal(got.completion_ids, own.completion_ids)
        assert torch.equal(got.sampler_logp, own.sampler_logp)


def off_by_a_little(step):
    # as a transformers version whose forward lean_step no longer mirrors would compute
    return lambda *args: step(*args) + 1e-3


def failing(step):
    # as a transformers version without the functions lean_step calls would; what it wrote to
    # the cache before failing must be cropped away
    def go(*args):
        step(*args)
        raise TypeError("create_causal_mask() got an unexpected keyword argument 'cache'")

    return go


@pytest.mark.parametrize(
    ("broken", "said_why"),
    [(off_by_a_little, "max |diff| 1.00e-03"), (failing, "TypeError: create_causal_mask()")],
)
def test_a_lean_step_that_is_off_is_said_once_and_the_model_keeps_its_own(
    engine, monkeypatch, capsys, broken, said_why
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(decode, "leanable", lambda model: False)
        own = sample(engine)
    real = decode.lean_step
    monkeypatch.setattr(decode, "lean_step", lambda model: broken(real(model)))
    got = [sample(engine), sample(engine)]
    said = [line for line in capsys.readouterr().err.splitlines() if "lean decode" in line]
    assert len(said) == 1 and type(engine.model).__name__ in said[0] and said_why in said[0]
    assert decode._VERIFIED[engine.model] is False
    for rollout in got:
        assert torch.equal(rollout.completion_ids, own.completion_ids)
        assert torch.equal(rollout.sampler_logp, own.sampler_logp)


def test_the_check_leaves_the_cache_as_the_models_own_forward_does(monkeypatch) -> None:
    # the checked step writes its token's keys and values twice: the first write is cropped
    model = llama()
    ids = torch.randint(0, 50, (2, 5))
    mask = torch.ones_like(ids)
    caches = []
    for step in (decode.decode_step(model), decode.own_step(model)):
        cache = reserved_cache(model, 10)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{decode.CACHE_ARG: cache}, use_cache=True)
            step(ids[:, -1], torch.ones(2, 6, dtype=torch.long), torch.full((2, 1), 5), cache)
        caches.append(cache)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 6
    for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_custom_code_under_a_transformers_class_name_keeps_its_own_forward() -> None:
    custom = type("LlamaForCausalLM", (LlamaForCausalLM,), {})  # defined here, not in transformers
    torch.manual_seed(0)
    assert not decode.leanable(custom(LlamaConfig(**SMALL)))


def test_a_global_module_hook_keeps_the_models_own_forward() -> None:
    # a hook for every module would miss the layer and attention calls lean_step skips
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not decode.leanable(llama())
    finally:
        handle.remove()
    assert decode.leanable(llama())


def test_nan_logits_in_both_paths_are_no_mismatch(capsys) -> None:
    # a diverged model gives NaN logits either way: that is no reason to leave the lean step
    model = llama()
    with torch.no_grad():
        model.lm_head.weight[0] = float("nan")
    ids = torch.randint(0, 50, (2, 5))
    cache = reserved_cache(model, 10)
    with torch.no_grad():
        model(input_ids=ids, **{decode.CACHE_ARG: cache}, use_cache=True)
        logits = decode.decode_step(model)(
            ids[:, -1], torch.ones(2, 6, dtype=torch.long), torch.full((2, 1), 5), cache
        )
    assert logits[:, 0].isnan().all() and not logits[:, 1:].isnan().any()
    assert decode._VERIFIED[model] is True and "lean decode" not in capsys.readouterr().err


def test_lora_adapters_run_in_the_lean_step(tiny_model_dir) -> None:
    # PEFT's LoRA wrapper only passes the call on; the adapted projections run their adapters
    policy = lora_policy(tiny_model_dir)
    assert decode.leanable(policy)
    with torch.no_grad():
        pairs = decode_both(policy)
        with policy.disable_adapter():
            base = decode_both(policy)
    assert all(torch.equal(own, lean) for own, lean in pairs)
    assert not torch.allclose(pairs[0][1], base[0][1], atol=1e-3)  # the adapters count


def test_peft_methods_that_change_the_call_keep_their_own_forward(tiny_model_dir) -> None:
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    def model():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    prompt = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)  # adds tokens
    activated = LoraConfig(task_type="CAUSAL_LM", r=2, alora_invocation_tokens=[3])
    hooked = lora_policy(tiny_model_dir)
    hooked.base_model.register_forward_pre_hook(lambda *a: None)  # a wrapper lean_step skips
    for wrapped in (get_peft_model(model(), prompt), get_peft_model(model(), activated), hooked):
        assert not decode.leanable(wrapped)
