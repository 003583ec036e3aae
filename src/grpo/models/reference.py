"""The reference policy of the KL term: frozen between refreshes."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from grpo.algorithm import soft_update_
from grpo.models.lora import is_lora


def linear_layers_of_their_own(model: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers of ``model`` whose weights no other module uses: a head
    tied to the input embedding is left out, since the embedding's lookup is no matrix product
    that autocast would cast."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    return [m for m in linears if all(users[id(p)] == 1 for p in m.parameters(recurse=False))]


class Reference:
    """The reference policy, frozen between refreshes.

    Full weights: a frozen deep copy made at start. LoRA: the policy with its adapters disabled
    (no second copy of the weights) until the first ``refresh``; from then on the base with a
    frozen snapshot of the trainable (adapter) weights, swapped in for the reference forward.

    ``alpha``: how each ``refresh`` mixes the policy in (1 copies it; LoRA: 1 only, since
    mixing the factors A and B does not mix B @ A).

    ``autocast``: the dtype every reference forward casts its matrix products to (bf16 under
    ``model.precision: bf16_autocast``). A copy refreshed by copying (alpha 1) then holds its linear layers'
    weights in it, which is what autocast would multiply anyway: the same log-probs, half their
    memory, and no cast per forward (autocast caches casts only of weights that take
    gradients). One that mixes stays float32: a mix rounded to bf16 would lose every step under
    half a bf16 unit.
    """

    def __init__(
        self, policy: nn.Module, autocast: torch.dtype | None = None, alpha: float = 1.0
    ) -> None:
        if not 0 < alpha <= 1:  # above 1 a refresh would extrapolate past the policy
            raise ValueError(f"Reference alpha must be in (0, 1], got {alpha}")
        self.policy = policy
        self.alpha = alpha
        self.copy: nn.Module | None = None
        self.adapter: dict[str, torch.Tensor] | None = None  # LoRA snapshot, None = adapters off
        self.refreshes = 0
        if is_lora(policy):
            if alpha != 1.0:
                raise ValueError("a LoRA reference can only be refreshed by copying (alpha 1)")
        else:
            self.copy = copy.deepcopy(policy).eval()
            self.copy.requires_grad_(False)
            if autocast is not None and alpha == 1.0:
                for layer in linear_layers_of_their_own(self.copy):
                    layer.to(autocast)

    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.policy.named_parameters() if p.requires_grad}

    @contextlib.contextmanager
    def _swapped_adapter(self) -> Iterator[nn.Module]:
        live = self._trainable()
        saved = {n: p.detach().clone() for n, p in live.items()}
        try:
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(self.adapter[n])
            yield self.policy
        finally:
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(saved[n])

    @contextlib.contextmanager
    def model(self) -> Iterator[nn.Module]:
        if self.copy is not None:
            yield self.copy
        elif self.adapter is None:
            with self.policy.disable_adapter():
                yield self.policy
        else:
            with self._swapped_adapter() as model:
                yield model

    def refresh(self) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref (iterative GRPO; alpha 1 copies exactly)."""
        if self.copy is None:
            self.adapter = {n: p.detach().clone() for n, p in self._trainable().items()}
        else:
            ref = self.copy.state_dict(keep_vars=True)
            pol = self.policy.state_dict(keep_vars=True)
            # tied weights (embeddings = LM head) appear under two names: mix each tensor once
            unique = {id(t): k for k, t in reversed(list(ref.items()))}
            keys = sorted(unique.values())
            soft_update_([ref[k] for k in keys], [pol[k] for k in keys], self.alpha)
        self.refreshes += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must carry: nothing until the first refresh (the start weights)."""
        if self.refreshes == 0:
            return {}
        return dict(self.adapter) if self.copy is None else self.copy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        if self.copy is None:
            self.adapter = {n: t.clone() for n, t in state.items()}
        else:
            self.copy.load_state_dict(state)
        self.refreshes = max(self.refreshes, 1)
