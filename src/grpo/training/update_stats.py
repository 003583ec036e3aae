"""Statistics of one update (loss terms, entropy, sampler mismatch), combined over micro-batches,
passes and ranks."""

from __future__ import annotations

import math

from torch import Tensor

from grpo import algorithm
from grpo.runtime import distributed

_EMPTY = (math.inf, -math.inf)  # the identities of min and max


class UpdateStats:
    """Statistics of an update, combined over micro-batches, passes and ranks.

    Means are weighted by the tokens they are over (the loss's counted tokens): a sum of
    value x tokens and a sum of tokens per metric, both summed over ranks, then divided, so a
    metric never divides a masked sum by tokens it did not count. Minima and maxima stay minima
    and maxima. The loss's statistics (clip fractions, ratio, KL) are recorded on every one of
    the ``num_iterations`` passes (the first pass's ratio is 1 by construction), and so are the
    shares the sampler/trainer corrections touched; entropy and the sampler mismatch describe
    the rollout and are recorded on the first pass.
    """

    LOSS_MEANS = ("clip_frac/low", "clip_frac/high", "kl", "ratio/mean")

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}  # key -> [sum of value x tokens, tokens]
        self.extremes: dict[str, tuple[str, float]] = {}

    def _add(self, key: str, weighted: float, tokens: float) -> None:
        total = self.sums.setdefault(key, [0.0, 0.0])
        total[0] += weighted
        total[1] += tokens

    def _extreme(self, key: str, op: str, value: float) -> None:
        old = self.extremes.get(key, (op, value))[1]
        self.extremes[key] = (op, min(old, value) if op == "min" else max(old, value))

    def add_pass(self, loss_stats: dict[str, Tensor], loss_mask: Tensor) -> None:
        """One micro-batch of any pass: ``policy_loss``'s statistics over loss_mask [b, T]."""
        tokens = float(loss_mask.sum())
        for key in self.LOSS_MEANS:
            if key in loss_stats:
                self._add(key, float(loss_stats[key]) * tokens, tokens)
        # with no counted token policy_loss's extremes are placeholders: record the identities
        # (every rank must reduce the same keys)
        low, high = (loss_stats["ratio/min"], loss_stats["ratio/max"]) if tokens else _EMPTY
        self._extreme("ratio/min", "min", float(low))
        self._extreme("ratio/max", "max", float(high))

    def add_shares(self, shares: dict[str, tuple[float, float]]) -> None:
        """One micro-batch of any pass: metric -> (units touched, units counted), as the
        sampler/trainer corrections report them (``grpo.training.importance``)."""
        for key, (touched, counted) in shares.items():
            self._add(key, touched, counted)

    def add_rollout(
        self,
        entropy: Tensor,
        loss_mask: Tensor,
        pg_mask: Tensor | None,
        logp: Tensor,
        sampler_logp: Tensor | None,
    ) -> None:
        """One micro-batch of the first pass; entropy, masks, logp, sampler_logp: [b, T]."""
        mask = loss_mask.bool()
        tokens = float(mask.sum())
        self._add("entropy", float(entropy.detach()[mask].sum()), tokens)
        if pg_mask is not None:
            self._add("entropy/kept_frac", float(pg_mask.sum()), tokens)
        if sampler_logp is not None:
            gap = algorithm.logprob_mismatch(logp, sampler_logp, mask)
            self._add("tis/mismatch_mean", float(gap["mismatch_mean"]) * tokens, tokens)
            high = gap["mismatch_max"] if tokens else _EMPTY[1]
            self._extreme("tis/mismatch_max", "max", float(high))

    def reduce(self) -> dict[str, float]:
        """Metrics over every rank (NaN for a mean over no counted token)."""
        out = {}
        for key, (weighted, tokens) in self.sums.items():
            tokens_all = distributed.all_reduce(tokens)
            out[key] = distributed.all_reduce(weighted) / tokens_all if tokens_all else math.nan
        for key, (op, value) in self.extremes.items():
            value = distributed.all_reduce(value, op)
            out[key] = value if math.isfinite(value) else math.nan
        return dict(sorted(out.items()))
