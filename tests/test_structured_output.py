"""logit_bias and structured outputs (nxdi_common/serving/structured.py, sampling.host_logits):
validation by field name, the wire round trip, the constraint's masks against llguidance used
directly, and a decode engine (tiny model, driven here turn by turn) whose greedy tokens are
transformers' logits biased / masked by hand; the served path is in test_openai_extras.py."""
import json
import re

import pytest
import torch

import hf_reference
from decode_service import main
from nxdi_common.serving import convert
from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.sampling import LOGPROB_FLOOR, host_logits, token_logprobs
from nxdi_common.serving.structured import GrammarCompiler
from nxdi_common.serving.types import (EOS_TOKEN, LENGTH, DecodeJob, ModelLimits,
                                       SamplingOptions, StopOptions, StructuredOutput,
                                       check_sampling)

PROMPT = [1, 504, 3458, 282, 4649, 314]
SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]}, "count": {"type": "integer"}},
    "required": ["answer", "count"], "additionalProperties": False}


# --- validation and the wire ---------------------------------------------------------------


@pytest.mark.parametrize("sampling,field,message", [
    (SamplingOptions(logit_bias=((5, 100.5),)), "logit_bias", "[-100, 100], got 100.5"),
    (SamplingOptions(logit_bias=((5, float("nan")),)), "logit_bias", "[-100, 100], got nan"),
    (SamplingOptions(logit_bias=((-1, 1.0),)), "logit_bias", "token ids >= 0, got -1"),
    (SamplingOptions(logit_bias=tuple((i, 1.0) for i in range(1025))), "logit_bias",
     "at most 1024 entries"),
    (SamplingOptions(structured=StructuredOutput("xml", "a")), "structured_output",
     "kind must be one of json_schema, regex, choice, lark_grammar"),
    (SamplingOptions(structured=StructuredOutput("json_schema", "[1, 2]")), "structured_output",
     "must be a JSON object (a schema), got list"),
    (SamplingOptions(structured=StructuredOutput("choice")), "structured_output",
     "1..256 alternatives, got 0"),
    (SamplingOptions(structured=StructuredOutput("regex", "  ")), "structured_output",
     "regex must not be empty"),
])
def test_bad_sampling_options_are_refused_by_name(sampling, field, message):
    with pytest.raises(InvalidRequest) as info:
        sampling.validate()
    assert info.value.field == field and message in str(info.value)


def test_logit_bias_ids_must_index_the_vocab():
    limits = ModelLimits(max_model_len=64, vocab_size=100)
    check_sampling(SamplingOptions(logit_bias=((99, 1.0),)), limits)
    with pytest.raises(InvalidRequest) as info:
        check_sampling(SamplingOptions(logit_bias=((100, 1.0),)), limits, "x.logit_bias")
    assert info.value.field == "x.logit_bias" and "outside [0, 100)" in str(info.value)


@pytest.mark.parametrize("structured", [
    None, StructuredOutput("json_schema", json.dumps(SCHEMA)), StructuredOutput("regex", "[0-9]+"),
    StructuredOutput("choice", choices=("yes", "no", "a|b")),
    StructuredOutput("lark_grammar", 'start: "a" | "b"')])
def test_logit_bias_and_structured_output_cross_the_wire(structured):
    s = SamplingOptions(temperature=0.5, logit_bias=((3, -100.0), (7, 2.5)), structured=structured)
    assert convert.sampling_from_proto(convert.sampling_to_proto(s)) == s


# --- host logits and the constraint ---------------------------------------------------------


def test_host_logits_add_the_bias_then_mask_to_the_constraint():
    logits = torch.zeros(8)
    s = SamplingOptions(logit_bias=((1, 2.0), (6, -100.0)), frequency_penalty=1.0)
    out = host_logits(logits, [1], s)
    assert out.tolist() == [0, 1, 0, 0, 0, 0, -100, 0] and logits.tolist() == [0] * 8

    class Only:  # a constraint allowing tokens 2 and 6
        def mask_logits(self, x):
            keep = torch.zeros(8, dtype=torch.bool)
            keep[[2, 6]] = True
            return x.masked_fill_(~keep, float("-inf"))

    masked = host_logits(logits, [1], s, Only())
    assert masked[2] == 0 and masked[6] == -100 and masked.isinf().sum() == 6
    logprob, top = token_logprobs(masked, 2, SamplingOptions(logprobs=True, top_logprobs=3))
    assert logprob == pytest.approx(0.0) and top[2].logprob == LOGPROB_FLOOR  # no -inf in JSON


@pytest.fixture(scope="module")
def compiler(tiny_chat_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    return GrammarCompiler(lambda: tokenizer, 49152, [2]), tokenizer


def _reference_allowed(tokenizer, so, prefix: list[int]) -> set[int]:
    """llguidance itself (no wrapper): the tokens it allows after prefix."""
    import llguidance
    import llguidance.hf
    from nxdi_common.serving.structured import grammar_text
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, eos_token=2),
                                   grammar_text(so), log_level=0)
    assert all(matcher.consume_token(t) for t in prefix)
    bits = matcher.compute_bitmask()
    return {i for i in range(49152) if bits[i // 8] >> (i % 8) & 1}


def test_a_choice_constraint_allows_exactly_the_alternatives(compiler):
    grammars, tokenizer = compiler
    so = StructuredOutput("choice", choices=("yes", "no way"))
    c = grammars.compile(so)
    allowed = set(c.allowed().nonzero().flatten().tolist())
    assert allowed == _reference_allowed(tokenizer, so, [])
    assert tokenizer.encode("yes")[0] in allowed and tokenizer.encode("maybe")[0] not in allowed
    no_way = tokenizer.encode("no way")
    for token in no_way:
        assert not c.done
        c.accept(token)
    assert c.done
    fresh = grammars.compile(so)
    with pytest.raises(RuntimeError, match="does not satisfy the constraint"):
        fresh.accept(tokenizer.encode("maybe")[0])


@pytest.mark.parametrize("so,message", [
    (StructuredOutput("regex", "[a-"), "regex does not compile"),
    (StructuredOutput("json_schema", '{"type": "foo"}'), "json_schema does not compile"),
    (StructuredOutput("lark_grammar", "start: nothing"), 'unknown name: "nothing"'),
])
def test_a_constraint_that_does_not_compile_names_the_field(compiler, so, message):
    with pytest.raises(InvalidRequest) as info:
        compiler[0].compile(so, "sampling_params.structured_output")
    assert info.value.field == "sampling_params.structured_output" and message in str(info.value)


# --- a decode engine against transformers ---------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    args = main.parse_args(["--model", str(tiny_chat_model), "--dtype", "float32", "--backend",
                            "eager", "--threads", "1", "--max-model-len", "256", "--kv-blocks",
                            "32", "--block-size", "16", "--max-batch-size", "4"])
    return main.build(args)[:2]


def generate(engine, rid, sampling, n, ignore_eos=True):
    servicer, engine = engine
    constraint = None if sampling.structured is None else servicer.grammars.compile(
        sampling.structured)
    out = []
    seq = engine.admit(DecodeJob(rid, tuple(PROMPT), sampling,
                                 StopOptions(n, ignore_eos=ignore_eos)), n, out.append,
                       constraint)
    engine.submit_local_prefill(seq)
    for _ in range(500):
        if seq.finished:
            assert not any(isinstance(o, Exception) for o in out), out
            return [o.token_id for o in out], out[-1].finish_reason
        engine._iterate()
    raise AssertionError("the sequence did not finish")


def test_biased_greedy_tokens_are_transformers_logits_biased_by_hand(engine, tiny_chat_model):
    model = hf_reference.load(tiny_chat_model)
    with torch.no_grad():
        plain_first = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
    bias = ((plain_first, -100.0), (4649, 4.0), (42, 1.5))
    sampling = SamplingOptions(temperature=0.0, logit_bias=bias)
    ids, want = list(PROMPT), []
    with torch.no_grad():
        for _ in range(16):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            for token, b in bias:
                logits[token] += b
            want.append(int(logits.argmax()))
            ids.append(want[-1])
    got, reason = generate(engine, "bias", sampling, 16)
    assert got == want and reason == LENGTH
    assert plain_first not in got  # the first token is biased too


def test_constrained_greedy_tokens_are_transformers_argmax_over_the_allowed(engine, compiler,
                                                                            tiny_chat_model):
    model, tokenizer = hf_reference.load(tiny_chat_model), compiler[1]
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    ids, want = list(PROMPT), []
    with torch.no_grad():
        for _ in range(40):
            allowed = _reference_allowed(tokenizer, so, want)
            if allowed <= {2}:  # only EOS: the output is complete
                break
            logits = model(torch.tensor([ids])).logits[0, -1]
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[list(allowed)] = True
            want.append(int(logits.masked_fill(~keep, float("-inf")).argmax()))
            ids.append(want[-1])
    got, reason = generate(engine, "json", SamplingOptions(temperature=0.0, structured=so), 40)
    assert got == want
    if reason == EOS_TOKEN:  # complete: it parses and keeps to the schema
        value = json.loads(tokenizer.decode(got))
        assert value["answer"] in ("yes", "no") and isinstance(value["count"], int)
    plain, _ = generate(engine, "free", SamplingOptions(temperature=0.0), 40)
    assert plain[:len(got)] != got  # the constraint changed the tokens


def test_sampled_constrained_outputs_match_and_replay(engine, compiler):
    tokenizer = compiler[1]
    so = StructuredOutput("regex", "(cat|dog)s? [0-9]{1,3}")
    sampling = SamplingOptions(temperature=1.0, seed=11, structured=so)
    texts = set()
    for i in range(4):
        got, reason = generate(engine, f"re{i}", SamplingOptions(temperature=1.0, seed=i,
                                                                 structured=so), 24)
        text = tokenizer.decode(got)
        assert re.fullmatch(r"(cat|dog)s? [0-9]{1,3}", text), text
        texts.add(text)
    assert len(texts) > 1  # sampling, not one forced path
    assert generate(engine, "a", sampling, 24) == generate(engine, "b", sampling, 24)
    servicer, engine_ = engine
    assert engine_.blocks.num_used_blocks == 0
