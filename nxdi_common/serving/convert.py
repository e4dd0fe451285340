"""Protobuf <-> internal types for the messages every service handles (sampling parameters, stop
criteria, token events, prefix-cache reports). Each service's own convert module builds on
these; nothing else in the services touches protobuf messages."""
from __future__ import annotations

from protos.nxdi.serving.v1 import serving_pb2 as pb
from nxdi_common.cache_journal import CacheReport
from nxdi_common.serving import types as t

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED, t.LENGTH: pb.FINISH_REASON_LENGTH,
    t.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN, t.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    t.STOP_STRING: pb.FINISH_REASON_STOP_STRING, t.CANCELLED: pb.FINISH_REASON_CANCELLED,
    t.ERROR: pb.FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


def sampling_from_proto(msg: pb.SamplingParams) -> t.SamplingOptions:
    """Unset temperature and top_p mean 1.0; the result is validated."""
    return t.SamplingOptions(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k, top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None, logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        structured=structured_from_proto(msg),
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        min_p=msg.min_p,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    ).validate()


def structured_from_proto(msg: pb.SamplingParams) -> t.StructuredOutput | None:
    if not msg.HasField("structured_output"):
        return None
    so = msg.structured_output
    kind = so.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return t.StructuredOutput(kind, choices=tuple(so.choice.choices))
    return t.StructuredOutput(kind, spec=getattr(so, kind))


def sampling_to_proto(s: t.SamplingOptions) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                            logprobs=s.logprobs, top_logprobs=s.top_logprobs,
                            presence_penalty=s.presence_penalty,
                            frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias),
                            min_p=s.min_p)
    if s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    so = s.structured
    if so is not None:
        if so.kind == "choice":
            msg.structured_output.choice.choices.extend(so.choices)
        else:
            setattr(msg.structured_output, so.kind, so.spec)
    return msg


def stop_from_proto(msg: pb.StopCriteria) -> t.StopOptions:
    """Unset max_tokens means up to the context length; the result is validated."""
    return t.StopOptions(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        stop_token_ids=tuple(msg.stop_token_ids), stop_strings=tuple(msg.stop_strings),
        ignore_eos=msg.ignore_eos, min_tokens=msg.min_tokens,
        skip_special_tokens=(msg.skip_special_tokens if msg.HasField("skip_special_tokens")
                             else True),
        include_stop_str_in_output=msg.include_stop_str_in_output).validate()


def stop_to_proto(s: t.StopOptions) -> pb.StopCriteria:
    return pb.StopCriteria(max_tokens=s.max_tokens, stop_token_ids=s.stop_token_ids,
                           stop_strings=s.stop_strings, ignore_eos=s.ignore_eos,
                           min_tokens=s.min_tokens, skip_special_tokens=s.skip_special_tokens,
                           include_stop_str_in_output=s.include_stop_str_in_output)


def logprobs_to_proto(items) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=x.token_id, logprob=x.logprob, text=x.text) for x in items]


def logprobs_from_proto(items) -> tuple[t.TokenLogprob, ...]:
    return tuple(t.TokenLogprob(x.token_id, x.logprob, x.text) for x in items)


def prompt_logprobs_to_proto(items) -> list[pb.PromptTokenLogprob]:
    return [pb.PromptTokenLogprob(token_id=x.token_id, logprob=x.logprob, rank=x.rank,
                                  top_logprobs=logprobs_to_proto(x.top_logprobs))
            for x in items]


def prompt_logprobs_from_proto(items) -> tuple[t.PromptLogprob, ...]:
    return tuple(t.PromptLogprob(x.token_id, x.logprob, x.rank,
                                 logprobs_from_proto(x.top_logprobs)) for x in items)


def token_to_proto(out: t.TokenOutput) -> pb.TokenEvent:
    event = pb.TokenEvent(request_id=out.request_id, token_id=out.token_id, text=out.text,
                          logprob=out.logprob, top_logprobs=logprobs_to_proto(out.top_logprobs),
                          index=out.index, finish_reason=FINISH_TO_PROTO[out.finish_reason])
    if out.prompt_logprobs:
        event.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
    if out.usage is not None:
        event.usage.CopyFrom(pb.Usage(prompt_tokens=out.usage.prompt_tokens,
                                      completion_tokens=out.usage.completion_tokens,
                                      cached_prompt_tokens=out.usage.cached_prompt_tokens))
    return event


def token_from_proto(event: pb.TokenEvent) -> t.TokenOutput:
    usage = None
    if event.HasField("usage"):
        usage = t.Usage(event.usage.prompt_tokens, event.usage.completion_tokens,
                        event.usage.cached_prompt_tokens)
    return t.TokenOutput(
        request_id=event.request_id, token_id=event.token_id, index=event.index, text=event.text,
        logprob=event.logprob if event.HasField("logprob") else None,
        top_logprobs=logprobs_from_proto(event.top_logprobs),
        finish_reason=FINISH_FROM_PROTO.get(event.finish_reason), usage=usage,
        prompt_logprobs=prompt_logprobs_from_proto(event.prompt_logprobs))


# --- prefix-cache reports (GetLoad) ----------------------------------------------------------


def cache_report_for(request: pb.GetLoadRequest, journal) -> pb.PrefixCacheReport | None:
    """The PrefixCacheReport a GetLoad reply carries: the journal's changes since the request's
    cache_cursor; None when the request set no cursor or the worker keeps no prefix cache
    (journal None)."""
    if journal is None or not request.HasField("cache_cursor"):
        return None
    cursor = request.cache_cursor
    return cache_report_to_proto(journal.since(cursor.instance, cursor.seq))


def cache_report_to_proto(report: CacheReport) -> pb.PrefixCacheReport:
    return pb.PrefixCacheReport(instance=report.instance, seq=report.seq,
                                snapshot=report.snapshot, stored=report.stored,
                                removed=report.removed)


def cache_report_from_proto(msg: pb.PrefixCacheReport) -> CacheReport:
    return CacheReport(msg.instance, msg.seq, msg.snapshot, tuple(msg.stored), tuple(msg.removed))
