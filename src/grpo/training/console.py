"""What a run says on the console besides its own lines: warnings about the config, and
transformers' progress bars (off with ``train.progress=false``, restored when the run ends)."""

from __future__ import annotations

import sys

import transformers

from grpo.config import Config
from grpo.training import advantages

# the gradient of beta * (logp - ref_logp) is beta * grad(logp), whose mean over sampled tokens
# is zero: in the loss, k1 does not pull the policy towards the reference
K1_WARNING = (
    "warning: algorithm.kl_estimator=k1 in the loss adds only zero-mean noise to the gradient "
    "(it does not pull towards the reference); use k3 (default) or k2"
)


def warn_about(config: Config) -> None:
    """One line for each setting that runs but does not do what its name suggests."""
    algo = config.algorithm
    # reinforce_pp puts the KL into the rewards, where k1 is the paper's estimator
    if algo.beta > 0 and algo.kl_estimator == "k1" and advantages.loss_beta(algo) > 0:
        print(K1_WARNING, file=sys.stderr)
    if line := staleness_beyond_the_run(config.rollout.max_staleness, config.train.steps):
        print(line, file=sys.stderr)


def staleness_beyond_the_run(staleness: int, steps: int) -> str | None:
    """The line for a ``rollout.max_staleness`` the run's schedule cannot use: step t samples with
    the weights after step t-1-k (the first weights while that is below 0), so from k = steps - 1
    on no step of the run samples with weights it trained."""
    if staleness < 1 or staleness < steps - 1:
        return None
    return (
        f"warning: rollout.max_staleness={staleness} with train.steps={steps}: every step "
        "trains on rollouts of the first weights (a step samples with the weights after step "
        f"t-1-k); at most {max(steps - 2, 0)} lets a step sample with trained weights"
    )


class TransformersBars:
    """transformers' loading and saving bars, off while ``progress`` is false; ``restore``
    puts them back as they were."""

    def __init__(self, progress: bool) -> None:
        self.were_on = transformers.utils.logging.is_progress_bar_enabled()
        if not progress:
            transformers.utils.logging.disable_progress_bar()

    def restore(self) -> None:
        if self.were_on:
            transformers.utils.logging.enable_progress_bar()
