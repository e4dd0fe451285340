"""API keys on real processes (tiny model; router started with two keys, workers on loopback):
/v1/ over HTTP and the gRPC Router service refuse a request without a right key (401 in OpenAI's
shape / UNAUTHENTICATED) and serve it with either key; probes and scrapes stay open; the OpenAI
SDK and the load generator send keys as clients do."""
import grpc
import httpx
import openai
import pytest

from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
from router.auth import ApiKeys, keys_from
from router.server import RouterSettings

KEYS = ("sk-first-key", "sk-second-key")


@pytest.fixture(scope="module")
def router(spawn_module, tiny_chat_model):
    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", 256)
    decode = spawn_module("decode_service", *common, "--kv-blocks", 64)
    prefill = spawn_module("prefill_service", *common)
    return spawn_module("router", "--model", tiny_chat_model, "--max-model-len", 256,
                        "--model-name", "tiny", "--http-port", 0, "--grpc-port", 0,
                        "--decode", decode.grpc, "--prefill", prefill.grpc,
                        "--api-key", KEYS[0], "--api-key", KEYS[1]).info


def get(router, path, key=None, scheme="Bearer"):
    headers = {"Authorization": f"{scheme} {key}".strip()} if key is not None else {}
    return httpx.get(f"http://{router['http']}{path}", headers=headers, timeout=30)


@pytest.mark.parametrize("key,scheme,why", [
    (None, "Bearer", "missing API key"), ("sk-first-key", "", "missing API key"),
    ("sk-wrong", "Bearer", "incorrect API key"), ("sk-first-ke", "Bearer", "incorrect API key"),
    (KEYS[0], "Basic", "missing API key")])
def test_v1_without_a_right_key_is_401_in_openai_shape(router, key, scheme, why):
    r = get(router, "/v1/models", key, scheme)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert why in r.json()["error"]["message"]
    for path in ("/v1/completions", "/tokenize"):
        post = httpx.post(f"http://{router['http']}{path}", timeout=30,
                          json={"prompt": "hi", "max_tokens": 2})
        assert post.status_code == 401


def test_either_key_serves_and_probes_stay_open(router):
    for key in KEYS:
        assert get(router, "/v1/models", key).json()["data"][0]["id"] == "tiny"
    assert get(router, "/v1/models", KEYS[1], scheme="bearer").status_code == 200
    assert get(router, "/health").status_code == 200
    assert get(router, "/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"http://{router['http']}/v1", api_key=KEYS[1])
    reply = client.chat.completions.create(model="tiny", max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{router['http']}/v1",
                      api_key="sk-nope").models.list()


def test_grpc_router_service_needs_a_key_in_its_metadata(router):
    with grpc.insecure_channel(router["grpc"]) as channel:
        stub = pb_grpc.RouterStub(channel)
        request = pb.GenerateRequest(prompt="hi", stop=pb.StopCriteria(max_tokens=2, ignore_eos=True))
        for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=10, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {KEYS[0]}"),)
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=good).models
        events = list(stub.Generate(request, timeout=30, metadata=good))
        assert len(events) == 2
        # the health service answers probes without a key
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_load_generator_sends_its_key(router):
    from nxdi_bench.configs import served_model_id
    url = f"http://{router['http']}"
    assert served_model_id(url, KEYS[0]) == "tiny"
    with pytest.raises(httpx.HTTPStatusError):
        served_model_id(url)


def test_keys_come_from_flags_and_the_environment_and_stay_out_of_reprs():
    assert keys_from(["b", " ", "a"], {"NXDI_API_KEY": "a, c,,"}) == ("a", "c", "b")
    assert keys_from([], {}) == ()
    assert not ApiKeys(()).enabled and ApiKeys(()).check(None) is None
    assert "sk-secret" not in repr(RouterSettings(api_keys=("sk-secret",)))


def test_nxdi_serve_check_sends_the_environment_key(router, monkeypatch):
    from nxdi_common.serving.launcher import LaunchError, chat_check
    url = f"http://{router['http']}"
    monkeypatch.setenv("NXDI_API_KEY", f"{KEYS[1]},{KEYS[0]}")
    assert isinstance(chat_check(url, "hi", 2), str)
    monkeypatch.delenv("NXDI_API_KEY")
    with pytest.raises(LaunchError, match="401"):
        chat_check(url, "hi", 2)
