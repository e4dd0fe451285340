"""Named workload mixes and the requests built from them.

A workload is a weighted mix of request classes; each class draws its prompt and output lengths
uniformly from inclusive ranges. Prompts are built from the model's tokenizer so that the server's
tokenization of the prompt text has exactly the drawn number of tokens, and everything is drawn
from one seeded ``numpy`` generator, so a (workload, seed, count) triple names the same requests
in every run."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

__all__ = ["RequestClass", "Workload", "WORKLOADS", "BenchRequest", "PromptBuilder",
           "get_workload", "draw_lengths", "draw_requests"]


@dataclass(frozen=True)
class RequestClass:
    """One kind of request: its share of the mix and inclusive token-length ranges."""

    name: str
    weight: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]

    def __post_init__(self):
        if self.weight <= 0:
            raise ValueError(f"request class {self.name!r}: weight must be > 0, got {self.weight}")
        for field_name in ("prompt_tokens", "output_tokens"):
            lo, hi = getattr(self, field_name)
            if not 1 <= lo <= hi:
                raise ValueError(f"request class {self.name!r}: {field_name} must be a range "
                                 f"1 <= low <= high, got ({lo}, {hi})")

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_tokens[1] + self.output_tokens[1]

    def scaled(self, factor: float) -> RequestClass:
        """Both ranges multiplied by ``factor`` (at least one token each)."""
        def scale(r):
            return (max(1, round(r[0] * factor)), max(1, round(r[1] * factor)))
        return replace(self, prompt_tokens=scale(self.prompt_tokens),
                       output_tokens=scale(self.output_tokens))


@dataclass(frozen=True)
class Workload:
    name: str
    classes: tuple[RequestClass, ...]
    description: str = ""

    @property
    def max_total_tokens(self) -> int:
        return max(c.max_total_tokens for c in self.classes)

    @property
    def probabilities(self) -> np.ndarray:
        w = np.array([c.weight for c in self.classes], dtype=np.float64)
        return w / w.sum()

    def scaled(self, factor: float) -> Workload:
        return replace(self, classes=tuple(c.scaled(factor) for c in self.classes))

    def fit(self, max_model_len: int) -> Workload:
        """This workload, scaled down (never up) so every request fits ``max_model_len``."""
        if self.max_total_tokens <= max_model_len:
            return self
        return self.scaled(max_model_len / self.max_total_tokens)


_CHAT = RequestClass("chat", 1.0, prompt_tokens=(32, 256), output_tokens=(32, 192))
_LONG = RequestClass("long", 1.0, prompt_tokens=(1024, 1792), output_tokens=(16, 64))

WORKLOADS: dict[str, Workload] = {
    "chat": Workload("chat", (_CHAT,), "short prompts (32-256 tokens), medium outputs (32-192)"),
    "long-context": Workload("long-context", (_LONG,),
                             "long prompts (1024-1792 tokens), short outputs (16-64)"),
    "mixed": Workload("mixed", (replace(_CHAT, weight=0.8), replace(_LONG, weight=0.2)),
                      "80% chat, 20% long-context: long prefills land among running decodes"),
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"workload: unknown name {name!r}; choose one of "
                         f"{', '.join(WORKLOADS)}") from None


@dataclass(frozen=True)
class BenchRequest:
    """One request of a run: which class, its prompt text and the exact token counts."""

    index: int
    kind: str
    prompt: str
    prompt_tokens: int
    output_tokens: int


class PromptBuilder:
    """Prompt texts that the tokenizer encodes to an exact number of tokens.

    Texts are runs of whole-word vocabulary entries (a leading space and ASCII letters), sampled
    at random so that prompts share no prefix beyond chance; each text is checked by encoding it
    again, and redrawn when a word pair merges or splits."""

    def __init__(self, tokenizer, max_tries: int = 50):
        self.tokenizer = tokenizer
        self.max_tries = max_tries
        self._words = self._word_ids(tokenizer)
        if len(self._words) < 100:
            raise ValueError("tokenizer: fewer than 100 whole-word tokens in the vocabulary; "
                             "cannot build prompts of exact length")

    @staticmethod
    def _word_ids(tokenizer) -> np.ndarray:
        ids = []
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            word = text[1:]
            if text.startswith(" ") and 3 <= len(word) <= 10 and word.isascii() and word.isalpha():
                ids.append(token_id)
        return np.array(ids, dtype=np.int64)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, n_tokens: int, rng: np.random.Generator) -> str:
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        for _ in range(self.max_tries):
            text = self.tokenizer.decode(rng.choice(self._words, size=n_tokens).tolist())
            text = text.lstrip()
            if self.count(text) == n_tokens:
                return text
        raise RuntimeError(f"no prompt of exactly {n_tokens} tokens after {self.max_tries} draws")


def draw_lengths(workload: Workload, n: int, seed: int) -> list[tuple[str, int, int]]:
    """``n`` (class name, prompt tokens, output tokens): classes by weight, lengths uniform over
    each class's inclusive ranges."""
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    kinds = rng.choice(len(workload.classes), size=n, p=workload.probabilities)
    out = []
    for k in kinds:
        cls = workload.classes[int(k)]
        p = int(rng.integers(cls.prompt_tokens[0], cls.prompt_tokens[1] + 1))
        o = int(rng.integers(cls.output_tokens[0], cls.output_tokens[1] + 1))
        out.append((cls.name, p, o))
    return out


def draw_requests(workload: Workload, n: int, builder: PromptBuilder, seed: int) -> list[BenchRequest]:
    """``n`` requests of ``workload`` (lengths from draw_lengths, prompt words from their own
    stream, so the lengths of a seed do not depend on the tokenizer)."""
    rng = np.random.default_rng([seed, 1])
    return [BenchRequest(i, kind, builder.build(p, rng), p, o)
            for i, (kind, p, o) in enumerate(draw_lengths(workload, n, seed))]
