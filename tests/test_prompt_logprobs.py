"""Prompt log-probabilities: NeuronBaseForCausalLM.forward_hidden + lm_logits give transformers'
logits at every prompt position (context encoding of a padded batch, and a chunk of a prompt
past position 0) and leave the same KV cache as forward(); over HTTP, `echo` and vLLM's
`prompt_logprobs` return transformers' log-probabilities of the prompt tokens through the
prefill worker and through a decode worker's local prefill."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdi_common.models.llama.modeling_llama import NeuronLlamaForCausalLM
from tests.test_chunked_prefill import TABLE, cached_kv, chunk_config, prompt, run_piece, slots


@pytest.fixture(scope="module")
def hf_all_logits(tiny_llama_ckpt):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_ckpt, torch_dtype=torch.float32)
    with torch.no_grad():
        return lambda ids: hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def compiled(tiny_llama_ckpt, tmp_path_factory):
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config())
    path = tmp_path_factory.mktemp("compiled") / "model"
    model.compile(path)
    model.load(path)
    return model


@pytest.mark.usefixtures("one_torch_thread")
def test_every_position_of_a_padded_batch_has_transformers_logits(compiled, hf_all_logits):
    """Context encoding, 2 prompts of 13 and 29 tokens right-padded to one batch (flat rows of
    the block layout's default table)."""
    model = compiled
    model.reset_kv_cache()
    a, b = prompt(13), [(i * 53 + 5) % 256 for i in range(29)]
    ids = torch.zeros(2, 29, dtype=torch.long)
    mask = torch.zeros(2, 29, dtype=torch.long)
    ids[0, :13], mask[0, :13] = torch.tensor(a), 1
    ids[1], mask[1] = torch.tensor(b), 1
    hidden = model.forward_hidden(ids, seq_ids=torch.tensor([0, 1]), attention_mask=mask)
    assert hidden.shape == (2, 29, 64)
    logits = model.lm_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (2, 29, 256)
    assert (logits[0, :13] - hf_all_logits(a)).abs().max() < 1e-4
    assert (logits[1] - hf_all_logits(b)).abs().max() < 1e-4
    # the cache continues like after forward(): a token generation step from each row
    step = model(torch.tensor([[7], [9]]), seq_ids=torch.tensor([0, 1])).logits
    assert (step[0] - hf_all_logits(a + [7])[-1]).abs().max() < 1e-4
    assert (step[1] - hf_all_logits(b + [9])[-1]).abs().max() < 1e-4


@pytest.mark.usefixtures("one_torch_thread")
def test_a_scored_chunk_past_position_0_has_transformers_logits_and_cache(compiled,
                                                                          hf_all_logits):
    model = compiled
    ids = prompt(27)
    model.reset_kv_cache()
    run_piece(model, ids, 0)
    whole_kv = cached_kv(model, 27).clone()
    model.reset_kv_cache()

    def scored(start, end):
        return model.lm_logits(model.forward_hidden(
            torch.tensor([ids[start:end]]), seq_ids=torch.tensor([0]),
            position_ids=torch.arange(start, end).unsqueeze(0),
            slot_mapping=torch.tensor([slots(start, end)]), block_table=torch.tensor([TABLE])))[0]
    pieces = torch.cat([scored(0, 16), scored(16, 24), scored(24, 27)])
    assert (pieces - hf_all_logits(ids)).abs().max() < 1e-4
    assert (cached_kv(model, 27) - whole_kv).abs().max() < 1e-5
    step = model(torch.tensor([[7]]), seq_ids=torch.tensor([0]),
                 position_ids=torch.tensor([[27]]), slot_mapping=torch.tensor([slots(27, 28)]),
                 block_table=torch.tensor([TABLE])).logits[0]
    assert (step - hf_all_logits(ids + [7])[-1]).abs().max() < 1e-4


def test_forward_hidden_refuses_a_padded_chunk_and_a_long_one(compiled):
    compiled.reset_kv_cache()
    run_piece(compiled, prompt(8), 0)
    with pytest.raises(ValueError, match="attention_mask must be all ones"):
        compiled.forward_hidden(torch.tensor([prompt(4)]), position_ids=torch.tensor([[8, 9, 10, 11]]),
                                attention_mask=torch.tensor([[1, 1, 1, 0]]),
                                block_table=torch.tensor([TABLE]))
    with pytest.raises(ValueError, match=r"S <= prefill_chunk_size \(8\)"):
        compiled.forward_hidden(torch.tensor([prompt(9)]),
                                position_ids=torch.arange(8, 17).unsqueeze(0),
                                block_table=torch.tensor([TABLE]))


# --- over HTTP, real processes (tiny model, eager) -------------------------------------------

MAX_LEN = 512
TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the "
        "green forest where nobody can see it.")


@pytest.fixture(scope="module")
def stacks(spawn_module, tiny_chat_model):
    """Two routers: one with a prefill worker (every prompt prefilled there), one with a decode
    worker alone (every prompt prefilled locally, in 16-token pieces, with a prefix cache)."""
    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", MAX_LEN)
    decode = spawn_module("decode_service", *common, "--kv-blocks", 128)
    prefill = spawn_module("prefill_service", *common)
    alone = spawn_module("decode_service", *common, "--kv-blocks", 128,
                         "--prefill-chunk-tokens", 16)
    router = ("router", "--model", tiny_chat_model, "--max-model-len", MAX_LEN, "--model-name",
              "tiny", "--http-port", 0, "--grpc-port", 0)
    routers = {"prefill worker": spawn_module(*router, "--decode", decode.grpc, "--prefill",
                                              prefill.grpc),
               "local": spawn_module(*router, "--decode", alone.grpc)}
    stacks = {name: r.info["http"] for name, r in routers.items()}
    stacks["grpc"] = routers["prefill worker"].grpc
    return stacks


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    """ids -> transformers' log-probabilities [len(ids), vocab] at every position."""
    import hf_reference
    model = hf_reference.load(tiny_chat_model)

    def logp(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_chat_model)


def post(http, path="/v1/completions", status=200, **body):
    r = httpx.post(f"http://{http}{path}", timeout=120, json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    return r.json()


def check_scores(listed, ids, logp, top):
    """vLLM's prompt_logprobs list against transformers: None first, then each prompt token
    with its logprob and rank, and the `top` most likely alternatives with theirs (ranks and
    sets within float noise: a random model's logits nearly tie)."""
    assert listed[0] is None and len(listed) == len(ids)
    for i in range(1, len(ids)):
        entry, row = listed[i], logp[i - 1]
        mine = entry[str(ids[i])]
        assert abs(mine["logprob"] - float(row[ids[i]])) < 1e-4, i
        x = float(row[ids[i]])
        assert int((row > x + 1e-4).sum()) + 1 <= mine["rank"] <= int((row > x - 1e-4).sum()) + 1
        alternatives = {int(k): v for k, v in entry.items() if int(k) != ids[i]}
        assert top - 1 <= len(alternatives) <= top
        kth = float(torch.topk(row, top).values[-1]) if top else float("inf")
        for token, value in alternatives.items():
            assert abs(value["logprob"] - float(row[token])) < 1e-4
            assert value["logprob"] >= kth - 1e-4 and 1 <= value["rank"] <= top


@pytest.mark.parametrize("where", ["prefill worker", "local"])
def test_echo_with_max_tokens_0_scores_the_prompt_like_transformers(stacks, where, reference,
                                                                   tokenizer):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 16  # several local pieces: scores cross their edges
    body = post(stacks[where], prompt=TEXT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice, logp = body["choices"][0], reference(ids)
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < 1e-4
    for i in range(1, len(ids)):  # the token itself and the 2 most likely (or near-ties)
        tops, second = lp["top_logprobs"][i], float(torch.topk(logp[i - 1], 2).values[-1])
        assert lp["tokens"][i] in tops and 2 <= len(tops) <= 3
        assert all(v >= second - 1e-4 for k, v in tops.items() if k != lp["tokens"][i])
    assert lp["text_offset"] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("where", ["prefill worker", "local"])
def test_prompt_logprobs_beside_an_unchanged_answer(stacks, where, reference, tokenizer):
    """vLLM's prompt_logprobs on completions: the scores, and the greedy answer a request
    without them gets; asked twice on the local stack (its prefix cache then holds the prompt,
    which a scored prompt computes again)."""
    ids = tokenizer.encode(TEXT)
    plain = post(stacks[where], prompt=ids, max_tokens=6, temperature=0, ignore_eos=True)
    for _ in range(2):
        scored = post(stacks[where], prompt=ids, max_tokens=6, temperature=0, ignore_eos=True,
                      prompt_logprobs=3)
        assert scored["choices"][0]["text"] == plain["choices"][0]["text"]
        check_scores(scored["choices"][0]["prompt_logprobs"], ids, reference(ids), 3)
    assert "prompt_logprobs" not in plain["choices"][0]


def test_echo_with_an_answer_whole_and_streamed(stacks, reference, tokenizer):
    http = stacks["prefill worker"]
    ids = tokenizer.encode(TEXT)
    body = dict(prompt=TEXT, echo=True, logprobs=1, max_tokens=5, temperature=0,
                ignore_eos=True)
    whole = post(http, **body)["choices"][0]
    answer = post(http, prompt=TEXT, logprobs=1, max_tokens=5, temperature=0,
                  ignore_eos=True)["choices"][0]
    assert whole["text"] == TEXT + answer["text"]
    lp = whole["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([i]) for i in ids] + answer["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids):] == pytest.approx(answer["logprobs"]["token_logprobs"],
                                                            abs=1e-4)
    assert lp["text_offset"][len(ids)] == len(TEXT)
    text, tokens = "", []
    with httpx.stream("POST", f"http://{http}/v1/completions", timeout=120,
                      json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                tokens += choice["logprobs"]["tokens"]
    assert text == whole["text"] and tokens == lp["tokens"]


def test_chat_prompt_logprobs_score_the_templated_prompt(stacks, reference, tokenizer):
    messages = [{"role": "user", "content": "Name three colours."}]
    body = post(stacks["prefill worker"], "/v1/chat/completions", messages=messages,
                max_tokens=3, temperature=0, prompt_logprobs=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert body["usage"]["prompt_tokens"] == len(ids)
    check_scores(body["prompt_logprobs"], ids, reference(ids), 0)


def test_bad_prompt_scoring_requests_are_refused_by_name(stacks):
    http = stacks["prefill worker"]
    for body, param in ((dict(prompt_logprobs=21), "prompt_logprobs"),
                        (dict(prompt_logprobs=-1), "prompt_logprobs"),
                        (dict(prompt_logprobs=1, stream=True), "prompt_logprobs"),
                        (dict(max_tokens=0), "max_tokens")):
        error = post(http, status=400, prompt=TEXT, **body)["error"]
        assert error["param"] == param, error
    error = post(http, "/v1/chat/completions", status=400, prompt_logprobs=1, stream=True,
                 messages=[{"role": "user", "content": "hi"}])["error"]
    assert error["param"] == "prompt_logprobs"


def test_a_scored_local_prefill_beside_running_sequences(stacks, reference, tokenizer):
    """While other sequences decode, a local prefill's pieces ride in their steps (the mixed
    sub-model); a prompt to score runs its pieces apart and still gets every score."""
    import threading
    http, ids = stacks["local"], tokenizer.encode(TEXT)
    running = threading.Event()

    def busy():
        with httpx.stream("POST", f"http://{http}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "Once upon a time", "max_tokens": 300,
                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                running.set()
    threads = [threading.Thread(target=busy) for _ in range(2)]
    for thread in threads:
        thread.start()
    assert running.wait(60)
    scored = post(http, prompt=ids, max_tokens=2, temperature=0, prompt_logprobs=1)
    check_scores(scored["choices"][0]["prompt_logprobs"], ids, reference(ids), 1)
    for thread in threads:
        thread.join()


def test_the_grpc_router_returns_prompt_scores_on_the_first_event(stacks, reference, tokenizer):
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
    ids = tokenizer.encode(TEXT)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                             sampling=pb.SamplingParams(temperature=0, prompt_logprobs=2),
                             stop=pb.StopCriteria(max_tokens=3))
    with grpc.insecure_channel(stacks["grpc"]) as channel:
        events = list(pb_grpc.RouterStub(channel).Generate(req, timeout=120))
    assert len(events) == 3 and not any(e.prompt_logprobs for e in events[1:])
    scores, logp = events[0].prompt_logprobs, reference(ids)
    assert [s.token_id for s in scores] == ids[1:]
    for i, s in enumerate(scores, 1):
        assert abs(s.logprob - float(logp[i - 1, ids[i]])) < 1e-4 and len(s.top_logprobs) == 2
        first, second = s.top_logprobs
        assert abs(first.logprob - float(logp[i - 1].max())) < 1e-4
        assert first.logprob >= second.logprob and s.rank >= 1


def test_lm_evaluation_harness_loglikelihood_requests(stacks, reference, tokenizer):
    """What lm-evaluation-harness's local-completions model sends for loglikelihood: a batch of
    token-id prompts (context + continuation), echo, logprobs 1, max_tokens 1, temperature 0;
    it sums token_logprobs[ctxlen:-1] and calls the continuation greedy when each of its tokens
    is the top of its top_logprobs. Both equal transformers'."""
    context = tokenizer.encode("The capital of France is")
    pairs = [(context, tokenizer.encode(" Paris, a large city.")),
             (context, tokenizer.encode(" a banana"))]
    prompts = [c + x for c, x in pairs]
    body = post(stacks["prefill worker"], prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                temperature=0, seed=1234)
    for (ctx, cont), prompt, choice in zip(pairs, prompts, body["choices"]):
        lp, logp = choice["logprobs"], reference(prompt)
        n = len(ctx)
        assert len(lp["tokens"]) == len(prompt) + 1
        got = sum(lp["token_logprobs"][n:-1])
        want = sum(float(logp[i - 1, prompt[i]]) for i in range(n, len(prompt)))
        assert abs(got - want) < 1e-3
        greedy = all(tok == max(top, key=top.get)
                     for tok, top in zip(lp["tokens"][n:-1], lp["top_logprobs"][n:-1]))
        assert greedy == all(int(logp[i - 1].argmax()) == prompt[i]
                             for i in range(n, len(prompt)))
