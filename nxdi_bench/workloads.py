"""Named workload mixes and the requests built from them.

A workload is a weighted mix of request classes; each class draws its prompt and output lengths
uniformly from inclusive ranges. A class may open every prompt with one of a few shared prefixes
(system prompts, the documents of a retrieval app, an agent's instructions), drawn uniformly:
there a prefix cache decides the prefill work. Prompts are built from the model's tokenizer so that the server's
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
    prompt_tokens: tuple[int, int]  # after the shared prefix, when the class has one
    output_tokens: tuple[int, int]
    shared_prefixes: int = 0  # how many distinct prefixes the prompts open with (0: none)
    prefix_tokens: int = 0  # each prefix's length

    def __post_init__(self):
        if self.weight <= 0:
            raise ValueError(f"request class {self.name!r}: weight must be > 0, got {self.weight}")
        if self.shared_prefixes < 0 or self.prefix_tokens < 0 \
                or (self.shared_prefixes > 0) != (self.prefix_tokens > 0):
            raise ValueError(f"request class {self.name!r}: shared_prefixes and prefix_tokens "
                             f"must both be > 0 or both 0, got {self.shared_prefixes} and "
                             f"{self.prefix_tokens}")
        for field_name in ("prompt_tokens", "output_tokens"):
            lo, hi = getattr(self, field_name)
            if not 1 <= lo <= hi:
                raise ValueError(f"request class {self.name!r}: {field_name} must be a range "
                                 f"1 <= low <= high, got ({lo}, {hi})")

    @property
    def max_total_tokens(self) -> int:
        return self.prefix_tokens + self.prompt_tokens[1] + self.output_tokens[1]

    def scaled(self, factor: float) -> RequestClass:
        """Both ranges and the prefix multiplied by ``factor`` (at least one token each)."""
        def scale(r):
            return (max(1, round(r[0] * factor)), max(1, round(r[1] * factor)))
        prefix = max(1, round(self.prefix_tokens * factor)) if self.prefix_tokens else 0
        return replace(self, prompt_tokens=scale(self.prompt_tokens),
                       output_tokens=scale(self.output_tokens), prefix_tokens=prefix)


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
_SHARED = RequestClass("shared", 1.0, prompt_tokens=(32, 256), output_tokens=(32, 192),
                       shared_prefixes=4, prefix_tokens=1024)

WORKLOADS: dict[str, Workload] = {
    "chat": Workload("chat", (_CHAT,), "short prompts (32-256 tokens), medium outputs (32-192)"),
    "long-context": Workload("long-context", (_LONG,),
                             "long prompts (1024-1792 tokens), short outputs (16-64)"),
    "mixed": Workload("mixed", (replace(_CHAT, weight=0.8), replace(_LONG, weight=0.2)),
                      "80% chat, 20% long-context: long prefills land among running decodes"),
    "shared-prefix": Workload("shared-prefix", (_SHARED,),
                              "one of 4 shared 1024-token prefixes (system prompts, documents) "
                              "and a 32-256-token question, outputs 32-192: prefix caches "
                              "decide the prefill work"),
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
    prompt_tokens: int  # the shared prefix included
    output_tokens: int
    prefix: int = -1  # which of its class's shared prefixes the prompt opens with (-1: none)


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

    def build(self, n_tokens: int, rng: np.random.Generator, after: str = "") -> str:
        """A text of ``n_tokens`` tokens; with ``after``, the text that follows it (returned
        whole: ``after`` and then the new words, ``n_tokens`` more than ``after`` alone)."""
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        base = self.count(after) if after else 0
        for _ in range(self.max_tries):
            text = self.tokenizer.decode(rng.choice(self._words, size=n_tokens).tolist())
            text = after + text if after else text.lstrip()
            if self.count(text) == base + n_tokens:
                return text
        raise RuntimeError(f"no prompt of exactly {n_tokens} tokens after {self.max_tries} draws")


def draw_lengths(workload: Workload, n: int, seed: int) -> list[tuple[str, int, int]]:
    """``n`` (class name, prompt tokens, output tokens): classes by weight, lengths uniform over
    each class's inclusive ranges (prompt tokens: its shared prefix's and the drawn ones)."""
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    kinds = rng.choice(len(workload.classes), size=n, p=workload.probabilities)
    out = []
    for k in kinds:
        cls = workload.classes[int(k)]
        p = int(rng.integers(cls.prompt_tokens[0], cls.prompt_tokens[1] + 1))
        o = int(rng.integers(cls.output_tokens[0], cls.output_tokens[1] + 1))
        out.append((cls.name, cls.prefix_tokens + p, o))
    return out


def draw_requests(workload: Workload, n: int, builder: PromptBuilder, seed: int) -> list[BenchRequest]:
    """``n`` requests of ``workload`` (lengths from draw_lengths, prompt words from their own
    stream, so the lengths of a seed do not depend on the tokenizer; shared prefixes and each
    request's choice of one from streams of their own)."""
    rng = np.random.default_rng([seed, 1])
    prefix_rng, pick_rng = np.random.default_rng([seed, 2]), np.random.default_rng([seed, 3])
    classes = {c.name: c for c in workload.classes}
    prefixes = {c.name: [builder.build(c.prefix_tokens, prefix_rng)
                         for _ in range(c.shared_prefixes)] for c in workload.classes}
    out = []
    for i, (kind, p, o) in enumerate(draw_lengths(workload, n, seed)):
        cls = classes[kind]
        if not cls.shared_prefixes:
            out.append(BenchRequest(i, kind, builder.build(p, rng), p, o))
            continue
        k = int(pick_rng.integers(cls.shared_prefixes))
        text = builder.build(p - cls.prefix_tokens, rng, after=prefixes[kind][k])
        out.append(BenchRequest(i, kind, text, p, o, prefix=k))
    return out
