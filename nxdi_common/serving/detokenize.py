"""Incremental detokenization with stop strings, for streaming one token at a time.

Decoding each token on its own breaks multi-byte characters and word-piece spacing, so the text a
token adds is the difference between decoding a short window of recent tokens with and without it;
a delta ending in U+FFFD (an incomplete UTF-8 sequence) is held until the next token completes it.
Stop strings: text that could still be the start of a stop string is held back, and when one
matches, the output ends just before it (vLLM's ``include_stop_str_in_output``: just after it).
``skip_special_tokens`` (default true, as vLLM's) leaves special tokens' text out."""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation is the decoded output."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context for the tokenizer's spacing rules
        self._read_offset = 0  # tokens before this have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """The text token_id adds (may be empty while a character is incomplete)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the very end), as decoded."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):]


class StopStringMatcher:
    """Feeds text deltas through stop-string matching: returns what is safe to emit now."""

    def __init__(self, stop_strings: tuple[str, ...] | list[str], include_stop: bool = False):
        self._stops = tuple(s for s in stop_strings if s)
        self._include = include_stop  # the matched string ends the text instead of being cut
        self._held = ""  # text not emitted yet: a suffix that may begin a stop string
        self.matched: str | None = None

    def feed(self, delta: str, active: bool = True) -> str:
        """Text to emit for this delta; after a match (``matched`` set) nothing more is emitted.
        Not ``active``: everything held and given is emitted, unmatched."""
        if self.matched is not None:
            return ""
        text = self._held + delta
        if not active:
            self._held = ""
            return text
        hits = [(text.find(s), s) for s in self._stops if s in text]
        if hits:
            index, self.matched = min(hits)
            self._held = ""
            return text[:index + len(self.matched) if self._include else index]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held text, released when the sequence ends for another reason."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


class OutputText:
    """Detokenizer and stop strings together: ``add`` returns (text to emit, stop string hit)."""

    def __init__(self, tokenizer, stop_strings=(), skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stops = StopStringMatcher(stop_strings, include_stop)

    def add(self, token_id: int, match_stops: bool = True) -> tuple[str, bool]:
        """match_stops False (before min_tokens): the text passes, no stop string can match."""
        text = self._stops.feed(self._detok.add(token_id), match_stops)
        return text, self._stops.matched is not None

    @property
    def stopped(self) -> bool:
        """A stop string matched."""
        return self._stops.matched is not None

    def finish(self) -> str:
        """Text still held when the sequence ends (not after a stop-string match)."""
        return self._stops.feed(self._detok.flush()) + self._stops.flush()
