"""OpenAI response shapes: completion and chat responses, their streaming chunks, logprobs,
usage, finish reasons and the model card. Pure functions of the tokens a decode worker streamed.

Prompt scores (the first token's ``prompt_logprobs``): vLLM's ``prompt_logprobs`` list (None for
the first prompt token, then {token id: {logprob, rank, decoded_token}} with the prompt token
and its alternatives), per choice on /v1/completions and once per response on chat; and the
completions ``echo``: the prompt's text before the completion's, and with ``logprobs`` its tokens
before the completion's in every logprobs list (token_logprobs and top_logprobs None for the
first prompt token, as OpenAI's)."""
from __future__ import annotations

import json
import time
from itertools import accumulate

import grpc

from nxdi_common.serving import types as t
from nxdi_common.serving.types import TokenOutput
from router.dispatch import WorkerError
from router.frontend import ModelFrontend, RoutedRequest
from router.tools import Content, ToolRequest

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
        self.prompt_logprobs = body.prompt_logprobs is not None  # vLLM's list asked for
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
        body["usage"] = self._usage(self._outs)
        return [body]

    def response(self, choices: list[list[TokenOutput]]) -> dict:
        """The non-streaming response: each choice's tokens."""
        body = self._envelope(self.object_name,
                              [self._full_choice(outs, i) for i, outs in enumerate(choices)])
        body["usage"] = self._usage(choices)
        return body

    def _usage(self, choices: list[list[TokenOutput]]) -> dict:
        return usage(self.prompts, choices)

    def _token_text(self, token_id: int, text: str = "") -> str:
        return text or self.frontend.token_text(token_id)

    def _prompt_of(self, index: int) -> int:
        """The prompt choice ``index`` answers."""
        return index // (self.n // len(self.prompts))

    def _scores(self, outs: list[TokenOutput]) -> tuple[t.PromptLogprob, ...]:
        """The prompt's scores, which ride on a choice's first token."""
        return outs[0].prompt_logprobs if outs else ()

    def _vllm_prompt_logprobs(self, outs: list[TokenOutput]) -> list:
        """vLLM's prompt_logprobs: None, then per prompt token {id: {logprob, rank,
        decoded_token}} for the token and its alternatives (module doc)."""
        listed: list = [None]
        for s in self._scores(outs):
            entry = {str(s.token_id): {"logprob": s.logprob, "rank": s.rank,
                                       "decoded_token": self._token_text(s.token_id)}}
            for rank, alt in enumerate(s.top_logprobs, 1):
                entry.setdefault(str(alt.token_id), {
                    "logprob": alt.logprob, "rank": rank,
                    "decoded_token": self._token_text(alt.token_id, alt.text)})
            listed.append(entry)
        return listed

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
        self.echo = bool(body.echo)
        # max_tokens 0 with echo: the prompt alone (the one token generated is not returned)
        self.echo_only = self.echo and body.max_tokens == 0
        self._prompt_texts = [p if isinstance(p, str) else frontend.tokenizer.decode(list(p))
                              for p in body.prompts] if self.echo else []

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

    def _echoed(self, index: int, outs: list[TokenOutput]) -> tuple[str, dict | None]:
        """The prompt's part of an echoed choice: its text, and with logprobs its tokens, their
        scores (None for the first) and their offsets in the text."""
        p = self._prompt_of(index)
        text = self._prompt_texts[p]
        if not self.logprobs:
            return text, None
        scores = self._scores(outs)  # one per prompt token after the first (echo asks them)
        tokens = [self._token_text(i) for i in self.prompts[p].prompt_ids]
        tops = [None] + [{self._token_text(s.token_id): s.logprob,
                          **{self._token_text(x.token_id, x.text): x.logprob
                             for x in s.top_logprobs if x.token_id != s.token_id}}
                         for s in scores]
        return text, {"tokens": tokens,
                      "token_logprobs": [None] + [s.logprob for s in scores],
                      "top_logprobs": tops,
                      "text_offset": list(accumulate([0] + [len(x) for x in tokens[:-1]]))}

    def _choice(self, index: int, outs: list[TokenOutput], offset: int, echo: bool,
                reason: str | None) -> dict:
        """A choice (or a stream's delta) of the tokens ``outs``, their text at ``offset`` of
        the choice's; ``echo``: the prompt first."""
        gen = [] if self.echo_only else outs
        text, logprobs = "".join(o.text for o in gen), self._logprobs(gen, offset)
        if echo:
            prompt_text, prompt_part = self._echoed(index, outs)
            text = prompt_text + text
            if prompt_part is not None:
                after = self._logprobs(gen, offset + len(prompt_text))
                logprobs = {key: prompt_part[key] + value for key, value in after.items()}
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": "length" if self.echo_only and reason else reason}

    def _delta_choice(self, out: TokenOutput, index: int) -> dict:
        echo = self.echo and out.index == 0
        choice = self._choice(index, [out], self._offsets[index], echo,
                              finish_reason(out.finish_reason))
        self._offsets[index] += len(choice["text"])
        return choice

    def _full_choice(self, outs: list[TokenOutput], index: int) -> dict:
        choice = self._choice(index, outs, 0, self.echo,
                              finish_reason(outs[-1].finish_reason if outs else None))
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(outs)
        return choice

    def _usage(self, choices: list[list[TokenOutput]]) -> dict:
        body = usage(self.prompts, choices)
        if self.echo_only:  # the token generated for it is not part of the answer
            body["completion_tokens"], body["total_tokens"] = 0, body["prompt_tokens"]
        return body


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
            self._parsers = [self.tools.parser() for _ in range(self.n)]
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
            message["content"], calls = self.tools.split(text)
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": self._logprobs(outs),
                "finish_reason": reason}

    def response(self, choices: list[list[TokenOutput]]) -> dict:
        body = super().response(choices)
        if self.prompt_logprobs:  # one prompt: vLLM puts its scores beside the choices
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(choices[0] if choices else [])
        return body

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
