"""Structured outputs: the output held to a JSON schema, a regex, a choice or a Lark grammar.

llguidance (a Rust library, also vLLM's and llama.cpp's) compiles the constraint against the
tokenizer's vocabulary and, token by token, says which next tokens keep the text a prefix of
something the constraint accepts. A worker compiles a request's constraint once
(:meth:`GrammarCompiler.compile`, off the event loop: the first call also builds llguidance's
view of the tokenizer, ~0.4 s), then for every token it samples: masks the row's logits to the
allowed tokens (:meth:`TokenConstraint.allowed`) and samples that row on the host
(nxdi_common/serving/sampling.py), and feeds the chosen token back (:meth:`TokenConstraint.accept`).
A prefill worker does the first token; the decode worker compiles the same constraint, feeds it
the first token it receives and does the rest. Once the constraint can take nothing more
(:attr:`TokenConstraint.done`) the sequence ends.

llguidance is imported when the first constraint is compiled, so a worker that never sees one
does not need it."""
from __future__ import annotations

import asyncio
import json
import threading

import numpy
import torch

from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.types import StructuredOutput

# JSON output: whitespace between tokens is allowed (pretty-printing) but at most 16 characters
# a gap, so a model that keeps choosing spaces (small ones do) still ends its object. A schema's
# own "x-guidance" options override these (llguidance's JSON compile options).
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
_META = set("\\.+*?()|[]{}^$#&-~")  # the characters a Rust regex escapes


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _META else c for c in text)


def grammar_text(so: StructuredOutput) -> str:
    """The constraint (validated) as an llguidance grammar (JSON text)."""
    from llguidance import LLMatcher
    if so.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(json.loads(so.spec), defaults=JSON_DEFAULTS)
    if so.kind == "regex":
        return LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(f"({_escape(c)})" for c in so.choices))
    return LLMatcher.grammar_from_lark(so.spec)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "invalid"


class TokenConstraint:
    """One request's constraint as it generates: which tokens may come next, and the tokens
    that came. Used by one thread at a time."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self._bits = numpy.zeros((vocab_size + 31) // 32, dtype=numpy.int32)  # llguidance's

    def allowed(self) -> torch.Tensor:
        """A bool mask [vocab_size] of the tokens that may come next."""
        bits = self._bits
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        # bit i of the little-endian words is token i
        flags = numpy.unpackbits(bits.view(numpy.uint8), bitorder="little")[:self.vocab_size]
        return torch.from_numpy(flags).view(torch.bool)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab_size] (float32, changed in place) with disallowed tokens at -inf."""
        allowed = self.allowed()
        if not bool(allowed.any()):
            raise RuntimeError(f"structured output: no token can come next "
                               f"({_first_line(self._matcher.get_error()) or 'constraint ended'})")
        return logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Take the generated token; a token the constraint does not allow is an error."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"structured output: token {token} does not satisfy the "
                               f"constraint: {_first_line(self._matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The constraint can take no more text (the output is complete)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (a worker's, or the router's to check them).
    Thread-safe; the llguidance tokenizer is built on first use and kept."""

    def __init__(self, load_tokenizer, vocab_size: int, eos_ids):
        """load_tokenizer: returns the model's Hugging Face (fast) tokenizer; called once, on
        first use. vocab_size: the model's (its logits' width)."""
        self._load_hf, self.vocab_size = load_tokenizer, vocab_size
        self._eos = sorted(int(e) for e in eos_ids)
        self._lock = threading.Lock()
        self._lltok = None

    def _tokenizer(self):
        with self._lock:
            if self._lltok is None:
                try:
                    import llguidance.hf
                except ImportError as exc:  # a dependency of the package; say what is missing
                    raise RuntimeError("structured outputs need the llguidance package "
                                       "(pip install llguidance)") from exc
                self._lltok = llguidance.hf.from_tokenizer(
                    self._load_hf(), n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._lltok

    def compile(self, so: StructuredOutput, field_name: str = "structured_output"
                ) -> TokenConstraint:
        """A fresh constraint for one request; InvalidRequest(field_name) when it does not
        compile (the message is llguidance's, first line)."""
        from llguidance import LLMatcher
        so.validate(field_name)
        tok = self._tokenizer()
        grammar = grammar_text(so)
        error = LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise InvalidRequest(field_name, f"{so.kind} does not compile: {_first_line(error)}")
        matcher = LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(field_name, f"{so.kind} does not compile: "
                                             f"{_first_line(matcher.get_error())}")
        return TokenConstraint(matcher, self.vocab_size)


async def compile_constraint(grammars: GrammarCompiler | None, sampling,
                             field_name: str = "sampling_params.structured_output"):
    """The request's compiled constraint (off the event loop), or None when it has none; a
    worker without a compiler refuses one."""
    so = sampling.structured
    if so is None:
        return None
    if grammars is None:
        raise InvalidRequest(field_name, "this worker does not serve structured outputs")
    return await asyncio.to_thread(grammars.compile, so, field_name)
