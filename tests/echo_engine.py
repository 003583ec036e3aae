"""What the environment tests share: an engine that answers from a script."""

from __future__ import annotations

from grpo.rollout.turns import TurnSample


class EchoEngine:
    """Answers a request whose context holds k observations (``<|tool|>`` messages) with
    ``replies[k]`` (the last one repeated) and EOS, cut to the request's budget; records each
    request's context as text."""

    def __init__(self, tokenizer, replies: str | list[str] = "hi") -> None:
        self.tokenizer = tokenizer
        self.eos = [tokenizer.eos_token_id]
        self.replies = [replies] if isinstance(replies, str) else replies
        self.contexts: list[str] = []

    def sync_weights(self, model) -> None:
        pass

    def generate_turns(self, requests, stop, greedy=False, temperature=None):
        out = []
        for r in requests:
            text = self.tokenizer.decode(r.context, skip_special_tokens=False)
            self.contexts.append(text)
            reply = self.replies[min(text.count("<|tool|>"), len(self.replies) - 1)]
            ids = [*self.tokenizer(reply, add_special_tokens=False).input_ids, *self.eos]
            out.append([TurnSample(ids[: r.max_tokens]) for _ in range(r.n)])
        return out
