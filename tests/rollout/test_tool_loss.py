"""Tool output and template tokens are context, never loss: the trainer's gradient over a
two-turn completion is the gradient over the model's own tokens."""

from __future__ import annotations

import pytest
import torch
from scripted_turns import ANSWER, CALL, QUESTION

from grpo.config import ModelConfig
from grpo.models import load_policy, load_tokenizer
from grpo.rollout import render_prompt
from grpo.scoring.logprobs import full_sequence_logprobs
from grpo.step_data import Rollout, Scored
from grpo.training.trainer import Trainer


def _two_turn_rollout(tokenizer) -> tuple[Rollout, int, int, int]:
    """One group of two hand-built completions: call, observation, answer (the second shorter)."""
    prompt = tokenizer(render_prompt(tokenizer, QUESTION, None), add_special_tokens=False).input_ids
    call = tokenizer(CALL, add_special_tokens=False).input_ids
    shown = tokenizer("<|end|><|tool|>408<|end|><|assistant|>", add_special_tokens=False).input_ids
    answer = [*tokenizer(ANSWER, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    rows = [call + shown + answer, call + shown + answer[:4]]
    width = len(rows[0])
    ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    sampled = mask.clone()
    sampled[:, len(call) : len(call) + len(shown)] = False
    rollout = Rollout(
        prompt_ids=torch.tensor([prompt, prompt]),
        prompt_mask=torch.ones(2, len(prompt), dtype=torch.bool),
        completion_ids=ids,
        completion_mask=mask,
        truncated=torch.tensor([False, True]),
        prompts=["p", "p"],
        completions=["", ""],
        rows=[{}],
        group_size=2,
        sampled_mask=sampled,
    )
    return rollout, len(prompt), len(call), len(shown)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trainer_gradient_equals_a_loop_over_the_models_own_tokens(tiny_config, loss_type) -> None:
    config = tiny_config(
        rollout={"tools": ["python"], "group_size": 2},
        algorithm={"beta": 0.0, "loss_type": loss_type},
        optim={"max_grad_norm": None, "micro_batch_size": 2},
    )
    trainer = Trainer(config)
    tokenizer = trainer.tokenizer
    rollout, _, n_call, n_shown = _two_turn_rollout(tokenizer)
    advantages = torch.tensor([1.0, -1.0])
    scored = Scored(rollout, torch.zeros(2, 1), ["x"], torch.zeros(2), advantages)
    start = {k: v.detach().clone() for k, v in trainer.state.policy.state_dict().items()}
    got = {}
    step = trainer.state.optimizer.step

    def keep_gradients(*args, **kwargs):  # the update frees them once its step is taken
        got.update({k: p.grad.detach().clone() for k, p in trainer.state.policy.named_parameters()})
        return step(*args, **kwargs)

    trainer.state.optimizer.step = keep_gradients
    trainer.optimize(scored)

    # reference: a fresh copy of the starting weights, one on-policy pass (ratio 1, gradient of
    # ratio = gradient of logp): grpo: loss = -1/G sum_i A_i mean_t logp_i,t; dapo: loss =
    # -sum_i A_i sum_t logp_i,t / (own tokens of both); t runs over the model's own tokens only,
    # each log-prob from one forward over the whole sequence
    model = load_policy(ModelConfig(name=config.model.name), config.model.name)
    model.load_state_dict(start)
    model.train()
    loss = torch.zeros(())
    own_total = int(rollout.loss_mask.sum())
    for i in range(2):
        n = int(rollout.completion_mask[i].sum())
        seq = torch.cat([rollout.prompt_ids[i], rollout.completion_ids[i, :n]])[None]
        logits = model(input_ids=seq).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        s = rollout.prompt_ids.shape[1]
        own = [t for t in range(n) if not n_call <= t < n_call + n_shown]
        terms = torch.stack([logp[s + t - 1, rollout.completion_ids[i, t]] for t in own])
        if loss_type == "grpo":
            loss = loss - advantages[i] * terms.mean() / 2
        else:
            loss = loss - advantages[i] * terms.sum() / own_total
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_observation_tokens_get_exactly_zero_weight(tiny_model_dir) -> None:
    from grpo.algorithm import LossKnobs, policy_loss

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir))
    rollout, _, n_call, n_shown = _two_turn_rollout(tokenizer)
    logp, _ = full_sequence_logprobs(
        model,
        rollout.prompt_ids,
        rollout.prompt_mask,
        rollout.completion_ids,
        rollout.completion_mask,
    )
    logp = logp.detach().requires_grad_(True)

    def loss_at(current: torch.Tensor) -> torch.Tensor:
        advantages = torch.tensor([1.0, -1.0])
        loss, _ = policy_loss(
            current, logp.detach(), advantages, rollout.loss_mask, knobs=LossKnobs(loss_type="grpo")
        )
        return loss

    loss = loss_at(logp)
    loss.backward()
    shown = slice(n_call, n_call + n_shown)
    assert torch.equal(logp.grad[:, shown], torch.zeros_like(logp.grad[:, shown]))
    assert (logp.grad[:, :n_call] != 0).all()
    # and changing the log-probs there changes nothing
    moved = logp.detach().clone()
    moved[:, shown] += 3.0
    assert torch.equal(loss_at(moved), loss)
