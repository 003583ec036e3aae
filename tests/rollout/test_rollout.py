"""HF rollout: grouping, padding, EOS masking, truncation flags, chat templates."""

from __future__ import annotations

import pytest
import torch

from grpo.config import RolloutConfig
from grpo.models import load_tokenizer
from grpo.rollout import completion_mask_and_truncation, render_prompt
from grpo.rollout.hf import HFEngine


def test_mask_stops_after_first_eos() -> None:
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]])
    mask, truncated = completion_mask_and_truncation(ids, [2])
    assert mask.tolist() == [
        [True, True, True, False, False],  # EOS itself counts, what follows does not
        [True] * 5,  # no EOS: every token counts, and the completion is truncated
        [True, False, False, False, False],
    ]
    assert truncated.tolist() == [False, True, False]


def test_chat_template_and_plain_prompts(tiny_model_dir) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    text = render_prompt(tok, "1+1?", "Be brief.")
    assert text == "<|system|>Be brief.<|end|><|user|>1+1?<|end|><|assistant|>"
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(tok, messages, None) == "<|user|>hi<|end|><|assistant|>"
    tok.chat_template = None
    assert render_prompt(tok, "1+1?", "Be brief.") == "Be brief.\n\n1+1?\n"


@pytest.mark.device
def test_generate_groups_padding_and_masks(tiny_model_dir, device) -> None:
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device)
    engine = HFEngine(model, tok, RolloutConfig(max_new_tokens=6, temperature=1.0))
    prompts = ["a", "a much longer prompt"]
    torch.manual_seed(0)
    out = engine.generate(prompts, [{"prompt": p} for p in prompts], group_size=3)
    assert out.completion_ids.shape[0] == 6 and out.completion_ids.shape[1] <= 6
    assert out.prompts == ["a"] * 3 + ["a much longer prompt"] * 3  # groups are contiguous
    # left padding: the short prompt's first columns are padding, its last column is real
    assert not out.prompt_mask[0, 0] and out.prompt_mask[0, -1] and out.prompt_mask[3].all()
    lengths = out.completion_mask.sum(dim=1)
    eos = tok.eos_token_id
    for i in range(6):
        n = int(lengths[i])
        assert out.completion_mask[i, :n].all() and not out.completion_mask[i, n:].any()
        has_eos = bool((out.completion_ids[i, :n] == eos).any())
        assert out.truncated[i].item() == (not has_eos)
        if has_eos:
            assert out.completion_ids[i, n - 1] == eos
        assert out.completions[i] == tok.decode(out.completion_ids[i, :n], skip_special_tokens=True)


def test_generation_kwargs_reach_hf_sampling_and_its_logprobs(tiny_model_dir) -> None:
    # bad_words_ids (a transformers GenerationConfig field) bans a token; the engine's log-probs
    # are of the distribution it really sampled (renormalised without the banned token), which
    # the trainer does not reproduce: the gap shows up in tis/mismatch_* and TIS corrects it
    from transformers import AutoModelForCausalLM

    from grpo.scoring.logprobs import completion_logprobs

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    banned = tok.convert_tokens_to_ids("e")
    config = RolloutConfig(max_new_tokens=16, generation_kwargs={"bad_words_ids": [[banned]]})
    out = HFEngine(model, tok, config).generate(["hello"] * 2, [{}] * 2, 8, seeds=[1, 2])
    counted = out.completion_mask
    assert banned not in out.completion_ids[counted].tolist()
    with torch.no_grad():
        trainer_logp, _ = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, counted, out.decoding
        )
    gap = (out.sampler_logp - trainer_logp)[counted]
    assert float(gap.min()) > -1e-5  # without the banned token every other token gains mass
    assert float(gap.max()) > 1e-3


def test_generation_kwargs_cannot_override_a_rollout_field(tiny_model_dir) -> None:
    import pytest
    from transformers import AutoModelForCausalLM

    from grpo.config import ConfigError

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"generation_kwargs\.top_p: set rollout\.top_p"):
        HFEngine(model, tok, RolloutConfig(generation_kwargs={"top_p": 0.5}))
    with pytest.raises(ConfigError, match=r"generation_kwargs\.nonsense: not a transformers"):
        HFEngine(model, tok, RolloutConfig(generation_kwargs={"nonsense": 1}))


def test_reward_inputs_repeat_each_rows_columns_for_its_group() -> None:
    from grpo.rewards.inputs import reward_inputs
    from grpo.step_data import Rollout

    n = 4  # 2 prompts, G = 2
    rollout = Rollout(
        prompt_ids=torch.ones(n, 3, dtype=torch.long),
        prompt_mask=torch.ones(n, 3, dtype=torch.bool),
        completion_ids=torch.tensor([[7, 8], [7, 0], [9, 9], [9, 0]]),
        completion_mask=torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]], dtype=torch.bool),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompts=["p0", "p0", "p1", "p1"],
        completions=["a", "b", "c", "d"],
        rows=[{"prompt": "q0", "answer": "1"}, {"prompt": "q1", "answer": "2", "tests": ["t"]}],
        group_size=2,
    )
    _, prompts, columns, ids = reward_inputs(rollout)
    assert prompts == ["q0", "q0", "q1", "q1"]
    # the prompt is passed as prompts; a column only some rows have is None in the others
    assert columns == {"answer": ["1", "1", "2", "2"], "tests": [None, None, ["t"], ["t"]]}
    assert ids == [[7, 8], [7], [9, 9], [9]]


def test_decoding_of_carries_every_rollout_control() -> None:
    from grpo.rollout import decoding_of
    from grpo.scoring.distribution import Decoding

    config = RolloutConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2)
    expected = Decoding(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2)
    assert decoding_of(config) == expected
    # a scheduled temperature replaces rollout.temperature only
    assert decoding_of(config, 1.3) == Decoding(1.3, 5, 0.9, 0.1, 1.2)


def test_an_unknown_engine_is_named() -> None:
    from grpo.build import build_engine

    with pytest.raises(ValueError, match=r"^unknown rollout engine 'sglang'$"):
        build_engine("sglang")


def _tagged_rollout(turns=None):
    from grpo.step_data import Rollout

    # 1 prompt that opens <think>, G = 2; single-turn, or multi-turn with the given turns
    return Rollout(
        prompt_ids=torch.ones(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        completion_ids=torch.tensor([[7, 8], [9, 0]]),
        completion_mask=torch.tensor([[True, True], [True, False]]),
        truncated=torch.zeros(2, dtype=torch.bool),
        prompts=["Assistant: <think>"] * 2,
        completions=["a</think>", "b</think>"],
        rows=[{"prompt": "q", "answer": "1"}],
        group_size=2,
        turns=turns,
    )


def test_rewards_judge_single_turns_after_the_opened_tag_and_the_last_turn_as_is() -> None:
    from grpo.rewards.inputs import reward_inputs

    texts, _, columns, _ = reward_inputs(_tagged_rollout())
    assert texts == ["<think>a</think>", "<think>b</think>"]
    assert columns == {"answer": ["1", "1"]}
    turns = [[{"text": "x"}, {"text": "last a"}], [{"text": "last b"}]]
    texts, _, columns, _ = reward_inputs(_tagged_rollout(turns))
    assert texts == ["last a", "last b"]  # the answer turn follows a tool output, not the tag
    assert columns == {"answer": ["1", "1"], "turns": turns}


def test_reward_inputs_of_no_prompts_are_empty() -> None:
    # a rank's empty share of a dynamic-sampling round
    from grpo.rewards.inputs import reward_inputs
    from grpo.training.gather import empty_rollout

    assert reward_inputs(empty_rollout(2)) == ([], [], {}, [])


def test_greedy_takes_the_most_likely_token_as_transformers_does(tiny_model_dir) -> None:
    # held-out eval's greedy answers: the engine's own decode loop gives the tokens of
    # transformers' greedy generate, for every member of a group, and reports no log-probs
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.generation_config.eos_token_id = None  # run to the limit: compare 12 tokens each
    engine = HFEngine(model, tok, RolloutConfig(max_new_tokens=12, temperature=1.7))
    prompts = ["What is 2 + 3?", "1"]
    out = engine.generate(prompts, [{}, {}], 2, seeds=[1, 2], greedy=True)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        expected = model.generate(
            **enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
        )[:, enc.input_ids.shape[1] :]
    n = out.completion_mask.sum(1)
    assert n.min() >= 3  # the random model's greedy path ends at EOS late, if at all
    for row in range(4):
        want = expected[row // 2]
        assert out.completion_ids[row, : n[row]].tolist() == want[: n[row]].tolist()
    assert out.sampler_logp is None


def test_greedy_applies_the_repetition_penalty_as_transformers_does(tiny_model_dir) -> None:
    # the penalty changes which token is most likely: greedy answers under a recipe's penalty are
    # transformers' greedy answers under the same penalty, not the plain argmax path
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.generation_config.eos_token_id = None
    prompts = ["What is 2 + 3?"]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")

    def engine_greedy(penalty: float) -> list[int]:
        config = RolloutConfig(max_new_tokens=16, repetition_penalty=penalty)
        out = HFEngine(model, tok, config).generate(prompts, [{}], 1, seeds=[0], greedy=True)
        return out.completion_ids[0, : int(out.completion_mask[0].sum())].tolist()

    with torch.no_grad():
        want = model.generate(
            **enc,
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=5.0,
            pad_token_id=tok.pad_token_id,
        )[0, enc.input_ids.shape[1] :].tolist()
    penalised = engine_greedy(5.0)
    assert penalised == want[: len(penalised)] and len(penalised) >= 3
    assert penalised != engine_greedy(1.0)[: len(penalised)]


def test_prompt_seeds_keep_the_given_ones_and_draw_the_rest_from_the_run_seed() -> None:
    from grpo.rollout import prompt_seeds

    assert prompt_seeds([3, 1], 2) == [3, 1]
    torch.manual_seed(0)
    drawn = prompt_seeds(None, 3)
    torch.manual_seed(0)
    assert prompt_seeds(None, 3) == drawn and len(set(drawn)) == 3
    assert all(0 <= s < 2**62 for s in drawn)
