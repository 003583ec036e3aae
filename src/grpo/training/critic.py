"""PPO's critic (``algorithm.estimator: ppo``): a value model scoring every completion token,
trained every step on GAE's returns with the clipped value loss (``grpo.algorithm``).

The model is a decoder body under a new value head (one linear layer from the hidden state to a
number, zero at the start): a float32 copy of the policy's decoder without its LM head, or the
decoder of ``algorithm.critic_model``. Its value at completion token t is read at the position
that predicts the token (the state before it is generated), as the policy's log-prob is. It has
its own AdamW (``algorithm.critic_lr``, constant) and goes into every checkpoint with its
optimizer state. This is the memory GRPO saves: a second model's weights, gradients, Adam
moments and activations (docs/results/ppo-vs-grpo.md).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModel

from grpo import algorithm
from grpo.config import Config
from grpo.models import is_lora, resolve_model_path
from grpo.runtime.precision import bf16_autocast
from grpo.scoring.logprobs import packing_groups, position_ids_from_mask
from grpo.scoring.packing import check_layout_used, packed_inputs
from grpo.scoring.prefix_attention import use_prefix_attention
from grpo.training.micro_batches import MicroBatch, scatter_rows
from grpo.training.optimizer import clip_and_step


class ValueModel(nn.Module):
    """A decoder body and a value head (``completion_values`` runs them)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(body.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # V = 0 at the start: the first advantages are returns
        nn.init.zeros_(self.head.bias)


def value_model(config: Config, policy: nn.Module) -> ValueModel:
    """The critic ``algorithm.critic_model`` names, else a copy of the policy's decoder."""
    name = config.algorithm.critic_model
    if name is not None:
        body = AutoModel.from_pretrained(resolve_model_path(name), dtype=torch.float32)
        use_prefix_attention(body)  # packed scoring without an [L, L] mask, as the policy's
    else:
        base = policy.get_base_model() if is_lora(policy) else policy
        body = copy.deepcopy(base.get_decoder())
    body = body.float()  # AdamW on bf16 weights would lose most updates (see optimizer.py)
    body.requires_grad_(True)
    return ValueModel(body)


def completion_values(model: ValueModel, mb: MicroBatch) -> Tensor:
    """[b, T] the value of each completion position, read where the token is predicted. The
    rows are packed by prompt as the policy's are scored (``grpo.scoring.packing``): a group's
    prompt once, under prefix attention where the body has it, else a dense mask."""
    body = model.body
    split = packing_groups(body, mb.prompt_ids, mb.prompt_mask, mb.completion_mask)
    if split is None or split[1]:
        # attention that takes no custom mask, a sliding window the sequences outgrow, or a
        # group whose packing costs more than its rows (long completions): the body's own
        # masks, one padded row per completion
        return _padded_values(model, mb)
    packed, inputs = packed_inputs(
        body, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask
    )
    hidden = body(**inputs).last_hidden_state
    check_layout_used(body, inputs)
    if isinstance(packed.keep, Tensor):  # end to end: these positions of the one sequence
        kept = hidden[0, packed.keep]  # [K, H]
    else:  # the last ``keep`` positions of every sequence
        kept = hidden[:, -packed.keep :].reshape(-1, hidden.shape[-1])
    return model.head(kept).squeeze(-1).float()[packed.at]


def _padded_values(model: ValueModel, mb: MicroBatch) -> Tensor:
    """``completion_values`` one padded row per completion, under the body's own masks."""
    ids = torch.cat([mb.prompt_ids, mb.completion_ids], dim=1)
    mask = torch.cat([mb.prompt_mask, mb.completion_mask], dim=1)
    hidden = model.body(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).last_hidden_state
    s, t = mb.prompt_ids.shape[1], mb.completion_ids.shape[1]
    return model.head(hidden[:, s - 1 : s - 1 + t]).squeeze(-1).float()


class Critic:
    """The value model with its optimizer: ``values`` before a step's update, ``update`` for
    each of its optimizer steps."""

    def __init__(self, config: Config, policy: nn.Module, device: torch.device) -> None:
        self.config, self.device = config, device
        self.model = value_model(config, policy).to(device).train()
        lr = config.algorithm.critic_lr or config.optim.lr
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=config.optim.weight_decay
        )

    def values(self, batches: list[MicroBatch], shape: tuple[int, int]) -> Tensor:
        """[N, T] values of every completion position of the step, before its update."""
        out = torch.zeros(shape, device=self.device)
        with torch.no_grad(), bf16_autocast(self.device, self.config.model.autocast, cache=False):
            for mb in batches:
                scatter_rows(out, mb, completion_values(self.model, mb))
        return out

    def update(
        self,
        batches: list[MicroBatch],
        returns: Tensor,
        old_values: Tensor,
        counted: Tensor,
        step: int,
        announce: bool,
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss over the step's micro-batches; returns
        ``value/loss``, ``value/clip_frac`` and ``value/grad_norm``."""
        algo = self.config.algorithm
        tokens = max(float(counted.sum()), 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        total, clipped = 0.0, 0.0
        for mb in batches:
            t = mb.completion_ids.shape[1]
            mask = counted[mb.index, :t]
            with bf16_autocast(self.device, self.config.model.autocast, cache=False):
                values = completion_values(self.model, mb)
            loss, stats = algorithm.value_loss(
                values,
                old_values[mb.index, :t],
                returns[mb.index, :t],
                mask,
                algo.value_clip,
                tokens,
            )
            loss.backward()
            total += float(loss.detach())
            clipped += float(stats["clip_frac"]) * float(mask.sum())
        # the policy's rule: a non-finite or zero gradient takes no step, and a non-finite one
        # says so in one line
        norm = clip_and_step(
            self.model,
            self.optimizer,
            None,  # a constant rate
            self.config.optim.max_grad_norm,
            step,
            announce,
            what="the critic",
        )
        return {"value/loss": total, "value/clip_frac": clipped / tokens, "value/grad_norm": norm}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def value_metrics(old_values: Tensor, returns: Tensor, counted: Tensor) -> dict[str, float]:
    """``value/mean`` (the critic's values when the step began) and ``value/explained_var``
    (1 - Var(R - V) / Var(R) over counted tokens: 1 a perfect critic, 0 no better than the
    mean, below 0 worse)."""
    mask = counted.bool()
    v, r = old_values[mask].double(), returns[mask].double()
    if v.numel() == 0:
        return {}
    var = r.var(unbiased=False)
    explained = 1 - (r - v).var(unbiased=False) / var if var > 0 else torch.tensor(math.nan)
    return {"value/mean": float(v.mean()), "value/explained_var": float(explained)}
