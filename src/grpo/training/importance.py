"""The sampler/trainer mismatch corrections of one micro-batch, as the config asks: importance
weights against the sampler's log-probs (``algorithm.tis_*``) and off-policy sequence masking
(``algorithm.offpolicy_mask_delta``), folded into the one weight tensor ``policy_loss`` takes."""

from __future__ import annotations

from torch import Tensor

from grpo import algorithm
from grpo.config import AlgorithmConfig

Shares = dict[str, tuple[float, float]]  # metric -> (units touched, units counted)


def correction(
    cfg: AlgorithmConfig,
    logp: Tensor,
    old_logp: Tensor,
    sampler_logp: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
) -> tuple[Tensor | None, Shares]:
    """Detached [b, T] weights for the surrogate (None: no correction) and what each option
    touched: ``tis/*_frac`` over counted tokens, ``tis/offpolicy_masked_frac`` over completions
    with a counted token. logp: [b, T] the current policy's (with grad); old_logp,
    sampler_logp: [b, T]; advantages: [b] or [b, T]; loss_mask: [b, T] bool."""
    weights, shares = None, {}
    if sampler_logp is not None and (cfg.tis_cap is not None or cfg.tis_low is not None):
        tokens = float(loss_mask.sum())  # a host sync: only when a correction is on
        weights, fracs = algorithm.importance_weights(
            old_logp,
            sampler_logp,
            loss_mask,
            cap=cfg.tis_cap,
            low=cfg.tis_low,
            level=cfg.tis_level,
            mode=cfg.tis_mode,
        )
        for key in (
            ("truncated_frac", "masked_frac") if cfg.tis_mode == "truncate" else ("masked_frac",)
        ):
            shares[f"tis/{key}"] = (float(fracs[key]) * tokens, tokens)
    if cfg.offpolicy_mask_delta is not None:
        # the behaviour policy: the sampler's own log-probs, else the weights that sampled
        behaviour = old_logp if sampler_logp is None else sampler_logp
        keep = algorithm.offpolicy_sequence_mask(
            logp, behaviour, advantages, loss_mask, cfg.offpolicy_mask_delta
        )  # [b]
        counted = loss_mask.any(dim=1)  # [b]
        shares["tis/offpolicy_masked_frac"] = (
            float((counted & ~keep).sum()),
            float(counted.sum()),
        )
        keep = keep[:, None].to(logp.dtype)  # [b, 1]
        weights = keep.expand_as(logp) if weights is None else weights * keep
    return weights, shares
