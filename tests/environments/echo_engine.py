"""What the environment tests share: an engine that answers every turn with a fixed text."""

from __future__ import annotations

from grpo.rollout.turns import TurnSample


class EchoEngine:
    """Answers every request with ``reply`` and EOS (cut to the request's budget); records each
    request's context as text."""

    def __init__(self, tokenizer, reply: str = "hi") -> None:
        self.tokenizer = tokenizer
        self.eos = [tokenizer.eos_token_id]
        self.reply = reply
        self.contexts: list[str] = []

    def sync_weights(self, model) -> None:
        pass

    def generate_turns(self, requests, stop, greedy=False, temperature=None):
        out = []
        for r in requests:
            self.contexts.append(self.tokenizer.decode(r.context, skip_special_tokens=False))
            ids = [*self.tokenizer(self.reply, add_special_tokens=False).input_ids, *self.eos]
            out.append([TurnSample(ids[: r.max_tokens]) for _ in range(r.n)])
        return out
