"""Moving averages the workers measure themselves by (thread-safe enough: one writer thread,
readers see either the old or the new float)."""
from __future__ import annotations


def moving_average(old: float | None, new: float, weight: float = 0.25) -> float:
    """Exponential moving average; ``new`` itself when there is no ``old`` yet."""
    return new if old is None else old + weight * (new - old)


class PrefillRate:
    """Prompt tokens per second a worker prefills while it has prompts to prefill: a moving
    average of seconds per token over its prefill calls (a prefill worker: each batch's prompt
    tokens over the batch's time; a decode worker: each local piece's tokens over the wall time
    since the previous piece, or since a prompt arrived to an empty queue). Reported in
    WorkerLoad.prefill_tokens_per_s, where a router turns tokens ahead into seconds."""

    def __init__(self, weight: float = 0.25):
        self.weight = weight
        self.s_per_token: float | None = None

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.s_per_token = moving_average(self.s_per_token, seconds / tokens, self.weight)

    @property
    def tokens_per_s(self) -> float:
        """0.0 until measured."""
        s = self.s_per_token
        return 0.0 if not s else 1.0 / s

    def left(self, tokens: int, elapsed_s: float) -> int:
        """Tokens of a call of ``tokens`` still to compute after ``elapsed_s`` (all of them
        until a rate is measured)."""
        rate = self.tokens_per_s
        return tokens if rate <= 0 else max(round(tokens - rate * elapsed_s), 0)
