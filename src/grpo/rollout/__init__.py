"""Rollout engines: turn P prompts into G completions each (a ``Rollout``).

An engine is any object with ``generate(prompts, rows, group_size, seeds=None, temperature=None)
-> Rollout`` and ``sync_weights(model)`` (called after each optimizer step and after a resume; a
no-op for engines that sample from the policy itself). ``seeds`` holds one seed per prompt: a
prompt's G completions must depend only on the prompt, the weights and its seed, never on the
other prompts of the batch. ``temperature`` overrides ``rollout.temperature`` for this call (a
schedule); the returned ``Rollout.decoding`` records the controls used, and the trainer scores
the tokens under exactly that distribution. ``greedy`` takes the most likely token at every step
instead (held-out evaluation; no sampler log-probs are reported).
``hf`` samples with Hugging Face ``generate``; ``vllm`` runs a colocated vLLM (``grpo.build``
picks one by ``rollout.engine``).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo.rollout.engine import (
        RolloutEngine,
        RolloutLost,
        completion_mask_and_truncation,
        decode_completions,
        decoding_of,
        grouped_rollout,
        prompt_seeds,
        release,
        render_prompt,
    )

__all__ = [
    "RolloutEngine",
    "RolloutLost",
    "completion_mask_and_truncation",
    "decode_completions",
    "decoding_of",
    "grouped_rollout",
    "prompt_seeds",
    "release",
    "render_prompt",
]


def __getattr__(name: str) -> Any:
    # torch and transformers load with the engines' shared parts (grpo.rollout.engine), not
    # with the package: ``grpo serve`` binds its address (grpo.rollout.listener) before them
    if name in __all__:
        from grpo.rollout import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'grpo.rollout' has no attribute {name!r}")
