"""OpenAI response shapes: completion and chat responses, their streaming chunks, logprobs,
usage, finish reasons and the model card. Pure functions of the tokens a decode worker streamed."""
from __future__ import annotations

import json
import time

import grpc

from nxdi_common.serving import types as t
from nxdi_common.serving.types import TokenOutput
from router.dispatch import WorkerError
from router.frontend import ModelFrontend, RoutedRequest
from router.tools import CallParser, Content, ToolRequest, split_output

SSE_DONE = "data: [DONE]\n\n"
FINISH_REASONS = {t.LENGTH: "length", t.EOS_TOKEN: "stop", t.STOP_TOKEN: "stop",
                  t.STOP_STRING: "stop", None: None}


def sse(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def finish_reason(reason: str | None) -> str | None:
    """Our finish reason -> OpenAI's ("length" or "stop"); a cancelled or failed sequence is an
    error (the worker gave up on it), not a finish."""
    if reason in FINISH_REASONS:
        return FINISH_REASONS[reason]
    raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                      f"the decode worker ended the request with finish reason {reason!r}")


def usage(prompts: list[RoutedRequest], choices: list[list[TokenOutput]]) -> dict:
    """OpenAI usage from each choice's last event's usage (or the counts seen): each prompt
    counted once (choices i * n .. i * n + n - 1 are prompt i's), the completions of every
    choice added up."""
    n = len(choices) // len(prompts)
    lasts = [outs[-1].usage if outs else None for outs in choices]
    firsts = [(lasts[i * n], routed) for i, routed in enumerate(prompts)]
    prompt = sum(last.prompt_tokens if last else len(routed.prompt_ids) for last, routed in firsts)
    cached = sum(last.cached_prompt_tokens for last, _ in firsts if last)
    completion = sum(last.completion_tokens if last else len(outs)
                     for last, outs in zip(lasts, choices))
    body = {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
    if cached:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def model_card(frontend: ModelFrontend) -> dict:
    return {"id": frontend.name, "object": "model", "created": frontend.created,
            "owned_by": "nxdi", "max_model_len": frontend.limits.max_model_len}


class Formatter:
    """Shapes one request's output: ``n`` choices of each of its prompts (``prompts``: a
    completions batch's, else the one ``routed``), prompt i's as choices i * n .. i * n + n - 1;
    subclasses define the endpoint's objects."""

    prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, frontend: ModelFrontend, routed: RoutedRequest, body, n: int = 1,
                 prompts: list[RoutedRequest] | None = None):
        self.frontend, self.routed = frontend, routed
        self.prompts = prompts or [routed]
        self.n = n * len(self.prompts)  # choices in all
        self.response_id = f"{self.prefix}-{routed.request_id}"
        self.created = int(time.time())
        self.logprobs = routed.sampling.logprobs
        self.include_usage = body.include_usage
        self._outs: list[list[TokenOutput]] = [[] for _ in range(self.n)]

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.frontend.name, "choices": choices}

    def _chunk(self, choices: list) -> dict:
        body = self._envelope(self.chunk_object_name, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def start_chunks(self) -> list[dict]:
        return []

    def token_chunk(self, out: TokenOutput, index: int = 0) -> dict:
        self._outs[index].append(out)
        return self._chunk([self._delta_choice(out, index)])

    def token_chunks(self, out: TokenOutput, index: int = 0) -> list[dict]:
        """The chunks one token's event makes (one, unless a subclass holds text back)."""
        return [self.token_chunk(out, index)]

    def end_chunks(self) -> list[dict]:
        """The usage chunk (choices empty) when stream_options.include_usage was set."""
        if not self.include_usage:
            return []
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage(self.prompts, self._outs)
        return [body]

    def response(self, choices: list[list[TokenOutput]]) -> dict:
        """The non-streaming response: each choice's tokens."""
        body = self._envelope(self.object_name,
                              [self._full_choice(outs, i) for i, outs in enumerate(choices)])
        body["usage"] = usage(self.prompts, choices)
        return body

    def _token_text(self, token_id: int, text: str = "") -> str:
        return text or self.frontend.token_text(token_id)

    def _delta_choice(self, out: TokenOutput, index: int) -> dict:
        raise NotImplementedError

    def _full_choice(self, outs: list[TokenOutput], index: int) -> dict:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    """``/v1/completions``: objects "text_completion"; legacy logprobs lists."""

    prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"

    def __init__(self, frontend, routed, body, n: int = 1, prompts=None):
        super().__init__(frontend, routed, body, n, prompts)
        self._offsets = [0] * self.n  # each choice's text so far

    def _logprobs(self, outs: list[TokenOutput], offset: int) -> dict | None:
        if not self.logprobs:
            return None
        offsets = []
        for out in outs:
            offsets.append(offset)
            offset += len(out.text)
        return {"tokens": [self._token_text(o.token_id) for o in outs],
                "token_logprobs": [o.logprob for o in outs],
                "top_logprobs": [{self._token_text(x.token_id, x.text): x.logprob
                                  for x in o.top_logprobs} for o in outs],
                "text_offset": offsets}

    def _delta_choice(self, out: TokenOutput, index: int) -> dict:
        choice = {"index": index, "text": out.text,
                  "logprobs": self._logprobs([out], self._offsets[index]),
                  "finish_reason": finish_reason(out.finish_reason)}
        self._offsets[index] += len(out.text)
        return choice

    def _full_choice(self, outs: list[TokenOutput], index: int) -> dict:
        return {"index": index, "text": "".join(o.text for o in outs),
                "logprobs": self._logprobs(outs, 0),
                "finish_reason": finish_reason(outs[-1].finish_reason if outs else None)}


class ChatFormatter(Formatter):
    """``/v1/chat/completions``: "chat.completion" / "chat.completion.chunk"; the stream opens
    with a {"role": "assistant", "content": ""} delta."""

    prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", \
        "chat.completion.chunk"

    def __init__(self, frontend, routed, body, n: int = 1, prompts=None,
                 tools: ToolRequest | None = None):
        super().__init__(frontend, routed, body, n, prompts)
        self.tools = tools if tools is not None and tools.parses_calls else None
        if self.tools is not None:
            first_only = not self.tools.parallel
            self._parsers = [CallParser(self.tools.names(), first_only) for _ in range(self.n)]
            self._blank = [""] * self.n  # trailing whitespace held: dropped if calls end it
            self._calls = [0] * self.n  # calls sent, each choice's

    def _entry(self, token_id: int, logprob: float | None, text: str = "") -> dict:
        token = self._token_text(token_id, text)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _logprobs(self, outs: list[TokenOutput]) -> dict | None:
        if not self.logprobs:
            return None
        content = []
        for o in outs:
            entry = self._entry(o.token_id, o.logprob)
            entry["top_logprobs"] = [self._entry(x.token_id, x.logprob, x.text)
                                     for x in o.top_logprobs]
            content.append(entry)
        return {"content": content}

    def start_chunks(self) -> list[dict]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for i in range(self.n)]

    def _delta_choice(self, out: TokenOutput, index: int) -> dict:
        return {"index": index, "delta": {"content": out.text},
                "logprobs": self._logprobs([out]),
                "finish_reason": finish_reason(out.finish_reason)}

    def _full_choice(self, outs: list[TokenOutput], index: int) -> dict:
        text = "".join(o.text for o in outs)
        message = {"role": "assistant", "content": text}
        reason = finish_reason(outs[-1].finish_reason if outs else None)
        if self.tools is not None:
            message["content"], calls = split_output(text, self.tools.names(),
                                                     not self.tools.parallel)
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": self._logprobs(outs),
                "finish_reason": reason}

    def token_chunks(self, out: TokenOutput, index: int = 0) -> list[dict]:
        """With tools: the content and calls this token settles, one chunk each (router/tools.py;
        whitespace waits for text to follow it); the token's logprobs ride on the
        first, the finish reason on the last (an empty delta when nothing else is due)."""
        if self.tools is None:
            return [self.token_chunk(out, index)]
        self._outs[index].append(out)
        parser = self._parsers[index]
        pieces = parser.feed(out.text)
        if out.finish_reason is not None:
            pieces += parser.finish()
        deltas = []
        for piece in pieces:
            if isinstance(piece, Content):
                text = self._blank[index] + piece.text
                body = text.rstrip()
                self._blank[index] = text[len(body):]
                if body:
                    deltas.append({"content": body})
            else:
                deltas.append({"tool_calls": [piece.as_openai(self._calls[index])]})
                self._calls[index] += 1
        reason = finish_reason(out.finish_reason)
        if reason is not None and self._blank[index] and not parser.calls:
            deltas.append({"content": self._blank[index]})
        if not deltas and (reason is not None or self.logprobs):
            deltas.append({})
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunks.append(self._chunk([{
                "index": index, "delta": delta,
                "logprobs": self._logprobs([out]) if i == 0 else None,
                "finish_reason": ("tool_calls" if parser.calls and reason == "stop" else reason)
                if last else None}]))
        return chunks
