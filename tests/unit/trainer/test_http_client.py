"""HTTPEngineClient against a mock transport: requests it sends, errors it raises again."""

import json

import httpx
import pytest

from weightsync import (
    EngineBusyError,
    EngineConfigError,
    EngineStateError,
    EngineTimeoutError,
    InvalidRequestError,
    SamplingParams,
    TornWeightsError,
    WeightTransferError,
    WeightTransferTimeout,
    WeightValidationError,
)
from weightsync.serve._protocol import CompletionRequest
from weightsync.trainer import EngineClient, HTTPEngineClient


def client_with(handler, **kwargs):
    client = HTTPEngineClient("http://engine.test", **kwargs)
    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(handler))
    return client


def error(status, error_type, message="it failed", **extra):
    body = {
        "error": {"message": message, "type": error_type, "param": None, "code": status, **extra}
    }
    return httpx.Response(status, json=body)


def test_it_is_an_engine_client():
    client: EngineClient = HTTPEngineClient("http://engine.test")
    assert client.base_url == "http://engine.test"


def test_calls_use_vllm_paths_parameters_and_the_admin_key():
    seen = []

    def handler(request):
        seen.append((request.method, request.url.path, dict(request.url.params),
                     request.headers.get("authorization"), request.content))  # fmt: skip
        return httpx.Response(200, json={"status": "ok", "stats": {"num_tensors": 3}})

    client = client_with(handler, admin_api_key="k")
    client.pause_generation(mode="keep", clear_cache=False)
    stats = client.update_weights({"update_info": {"names": ["a"]}})
    client.finish_weight_update("v2")
    assert seen[0][:4] == ("POST", "/pause", {"mode": "keep", "clear_cache": "false"}, "Bearer k")
    assert seen[1][1] == "/update_weights"
    assert json.loads(seen[1][4]) == {"update_info": {"names": ["a"]}}
    assert stats.num_tensors == 3
    assert json.loads(seen[2][4]) == {"weight_version": "v2"}


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        (error(409, "EngineBusyError"), EngineBusyError),
        (error(409, "TornWeightsError"), TornWeightsError),
        (error(400, "WeightValidationError"), WeightValidationError),
        (error(400, "InvalidRequestError"), InvalidRequestError),
        (error(504, "WeightTransferTimeout"), WeightTransferTimeout),
        (error(409, "SomethingNew"), EngineStateError),
        (httpx.Response(500, text="boom"), EngineStateError),
        (httpx.Response(401, json={"detail": "no"}), InvalidRequestError),
    ],
)
def test_an_error_answer_is_raised_as_the_class_it_names(answer, raised):
    client = client_with(lambda request: answer)
    with pytest.raises(raised, match=r"POST /start_weight_update -> \d+"):
        client.start_weight_update()


def test_a_partial_transfer_failure_keeps_partially_applied():
    client = client_with(lambda r: error(502, "WeightTransferError", partially_applied=True))
    with pytest.raises(WeightTransferError) as caught:
        client.update_weights({"update_info": {}})
    assert caught.value.partially_applied


def test_transport_failures_are_weightsync_errors():
    def timeout(request):
        raise httpx.ReadTimeout("slow", request=request)

    def refused(request):
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(EngineTimeoutError, match="did not answer within"):
        client_with(timeout).resume_generation()
    with pytest.raises(EngineStateError, match="cannot reach"):
        client_with(refused).resume_generation()


def test_generate_maps_choices_to_request_outputs():
    def handler(request):
        body = json.loads(request.content)
        assert body["prompt"] == ["hi"] and body["logprobs"] == 0 and body["stream"] is False
        choice = {"index": 0, "text": "yo", "token_ids": [121, 111], "weight_versions": [1, 2],
                  "finish_reason": "length", "prompt_token_ids": [256, 104, 105],
                  "logprobs": {"token_logprobs": [-0.5, -0.25], "top_logprobs": [{}, {}]}}  # fmt: skip
        return httpx.Response(200, json={"id": "cmpl-1", "choices": [choice]})

    out = client_with(handler).generate(["hi"], SamplingParams(max_tokens=2, logprobs=0))[0]
    assert out.finished and out.prompt == "hi" and out.prompt_token_ids == [256, 104, 105]
    assert out.outputs[0].weight_versions == [1, 2]
    assert out.outputs[0].logprobs == [-0.5, -0.25]


def test_stream_accumulates_chunks():
    chunks = [
        {"id": "c", "choices": [{"index": 0, "text": "a", "token_ids": [97],
                                 "weight_versions": [0], "finish_reason": None}]},
        {"id": "c", "choices": [{"index": 0, "text": "b", "token_ids": [98],
                                 "weight_versions": [1], "finish_reason": "length"}]},
    ]  # fmt: skip
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    client = client_with(lambda r: httpx.Response(200, text=text))
    outputs = list(client.stream("x"))
    assert [o.outputs[0].text for o in outputs] == ["a", "ab"]
    assert outputs[-1].outputs[0].weight_versions == [0, 1]
    assert outputs[-1].finished


def test_every_sampling_field_reaches_the_server():
    """The body of generate and of stream means, to the server, the very SamplingParams given."""
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.3,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=11, stop=["\n"], stop_token_ids=[7],
        ignore_eos=True, min_tokens=3, skip_special_tokens=False, include_stop_str_in_output=True,
        logprobs=2,
    )  # fmt: skip
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        choice = {"index": 0, "text": "", "token_ids": [], "weight_versions": [],
                  "finish_reason": "length", "logprobs": None}  # fmt: skip
        if bodies[-1]["stream"]:
            return httpx.Response(
                200, text=f"data: {json.dumps({'id': 'c', 'choices': [choice]})}\n\n"
            )
        return httpx.Response(200, json={"id": "cmpl-1", "choices": [choice]})

    client = client_with(handler)
    client.generate(["hi"], params)
    list(client.stream("hi", params))
    for body in bodies:
        request = CompletionRequest.model_validate(body)
        assert request.sampling_params(request.max_tokens, request.logprobs, 0) == params, body


@pytest.mark.reliability("bad-input")
def test_a_key_outside_ascii_is_sent_as_utf8():
    """`HTTPEngineClient(admin_api_key=...)` outside ASCII: sent as UTF-8, not a bare error."""
    seen = []

    def handler(request):
        seen.append(dict(request.headers.raw)[b"Authorization"])
        return httpx.Response(200, json={"status": "paused"})

    client_with(handler, admin_api_key="clé-🔑").pause_generation(mode="keep")
    assert seen == [b"Bearer " + "clé-🔑".encode()]
    with pytest.raises(EngineConfigError, match="admin_api_key cannot travel in an HTTP header"):
        HTTPEngineClient("http://engine.test", admin_api_key="two\nlines")
