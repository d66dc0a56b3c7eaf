"""vLLM's rule for request fields, and vLLM's fields that change the answer, over HTTP.

Unknown fields are ignored as vLLM ignores them (logged once, with the request id, and named in
`X-Ignored-Fields`), or refused by a strict server. Each field of vLLM's that changes the answer
is honoured, streamed and not, on both routes where it applies, or refused by a 400 naming it.
"""

import json
import logging
import math

import pytest
import torch
from fastapi.testclient import TestClient

from weightsync import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from weightsync.engine.chat_template import ChatTemplate
from weightsync.serve import ServerConfig, create_app
from weightsync.serve._front.fleet import replica_argv
from weightsync.serve.cli import _parse_serve_args

PROMPT = "The weights move"
MESSAGES = [{"role": "user", "content": "hi"}]
HEADER = "X-Ignored-Fields"


def _app(**config):
    engine = AsyncEngine("debug", engine_config=EngineConfig(num_kv_blocks=128))
    return create_app(engine, ServerConfig(model_name="debug", **config))


@pytest.fixture(scope="module")
def client():
    with TestClient(_app()) as client:
        yield client


@pytest.fixture(scope="module")
def strict():
    with TestClient(_app(strict_request_fields=True)) as client:
        yield client


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=128))


def _body(chat, **fields):
    base = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    return {**base, "max_tokens": 6, "temperature": 0, **fields}


def _route(chat):
    return "/v1/chat/completions" if chat else "/v1/completions"


def answer(client, chat=False, **fields):
    """The whole answer (a dict), and the response's headers."""
    response = client.post(_route(chat), json=_body(chat, **fields))
    assert response.status_code == 200, response.text
    return response.json(), response.headers


def stream(client, chat=False, **fields):
    """The chunks' choices of a stream (usage and [DONE] left out), and the headers."""
    body = _body(chat, stream=True, **fields)
    with client.stream("POST", _route(chat), json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        headers = response.headers
    return [
        c for line in lines for c in json.loads(line.removeprefix("data: "))["choices"]
    ], headers


def refused(client, chat=False, **fields):
    response = client.post(_route(chat), json=_body(chat, **fields))
    assert response.status_code == 400, response.text
    return response.json()["error"]


BOTH = pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
STREAMED = pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])

# --- 1. unknown fields --------------------------------------------------------------------------


@BOTH
@STREAMED
def test_unknown_fields_are_ignored_logged_once_with_the_id_and_named_in_a_header(
    client, caplog, chat, streamed
):
    fields = {"request_id": f"ignored-{chat}-{streamed}", "frobnicate": 1, "zeta": "z",
              "guided_json": {"type": "object"}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="weightsync.serve"):
        if streamed:
            choices, headers = stream(client, chat, **fields)
            assert choices[-1]["finish_reason"] == "length"
        else:
            body, headers = answer(client, chat, **fields)
            assert len(body["choices"][0]["token_ids"]) == 6
    # vLLM dropped the guided_* fields: it ignores them as it ignores any unknown field.
    assert headers[HEADER] == "frobnicate, guided_json, zeta"
    lines = [r.getMessage() for r in caplog.records if "ignored unknown field" in r.getMessage()]
    assert lines == [
        f"request ignored-{chat}-{streamed}: ignored unknown field(s) frobnicate, guided_json, zeta"
    ]


def test_nested_unknown_fields_are_named_by_their_path_and_known_ones_name_nothing(client):
    _, headers = stream(client, stream_options={"include_usage": True, "extra": 1})
    assert headers[HEADER] == "stream_options.extra"
    _, headers = answer(client, n=1)
    assert HEADER not in headers


@pytest.mark.parametrize(
    ("name", "shown"),
    [("a\r\nset-cookie: x", "a\\r\\nset-cookie: x"), ("\u00e4\u20ac", "\\xe4\\u20ac")],
    ids=["crlf", "non-ascii"],
)
def test_an_unknown_field_name_is_escaped_in_the_header_and_the_log(client, caplog, name, shown):
    with caplog.at_level(logging.WARNING, logger="weightsync.serve"):
        _, headers = answer(client, request_id=f"escaped-{len(name)}\n", **{name: 1})
    assert headers[HEADER] == shown and "set-cookie" not in headers
    lines = [r.getMessage() for r in caplog.records if "ignored unknown field" in r.getMessage()]
    assert lines == [f"request escaped-{len(name)}\\n: ignored unknown field(s) {shown}"]


def test_the_header_of_ignored_fields_is_bounded_however_long_the_names(client):
    _, headers = answer(client, **{"x" * 100_000: 1, "y" * 100_000: 2})
    assert len(headers[HEADER]) <= 1024 and headers[HEADER].startswith("xxx")


def test_a_chat_messages_own_fields_go_to_the_template_rather_than_being_ignored(client):
    messages = [{"role": "user", "content": "hi", "tool_call_id": "x"}]
    _, headers = answer(client, True, messages=messages)
    assert HEADER not in headers


def test_a_tool_conversation_reaches_the_template_whole():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]  # fmt: skip
    with _templated_client() as client:
        body, headers = answer(client, True, messages=messages, tools=TOOLS)
    assert bytes(body["prompt_token_ids"]).decode() == (
        "[user]hi[assistant][calls:f][tool]42[tools:lookup][assistant]"
    )
    assert HEADER not in headers


def test_rl_route_bodies_follow_the_same_rule(client, strict):
    loose = client.post("/update_weight_version", json={"new_version": 3, "note": "x"})
    assert loose.status_code == 200, loose.text
    assert loose.headers[HEADER] == "note"
    refusal = strict.post("/update_weight_version", json={"new_version": 3, "note": "x"})
    assert refusal.status_code == 400
    assert refusal.json()["error"]["param"] == "note"


@BOTH
def test_a_strict_server_refuses_unknown_fields_naming_them(strict, chat):
    error = refused(strict, chat, max_token=3)
    assert error["param"] == "max_token"
    assert "unknown field(s) 'max_token'" in error["message"]
    assert "--strict-request-fields" in error["message"]
    nested = refused(strict, chat, stream=True, stream_options={"include_usage": True, "x": 1})
    assert nested["param"] == "stream_options.x"


def test_strictness_is_a_serve_flag_that_replicas_inherit():
    args, transfer = _parse_serve_args(["serve", "tiny", "--strict-request-fields"])
    assert args.strict_request_fields is True
    assert "--strict-request-fields" in replica_argv(args, transfer)
    args, _ = _parse_serve_args(["serve", "tiny"])
    assert args.strict_request_fields is False


# --- 2. fields that change the answer -----------------------------------------------------------


def _choice_tokens(choices):
    return [t for c in choices for t in c["token_ids"]]


@BOTH
@STREAMED
def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(client, chat, streamed):
    logprobs = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    fields = {**logprobs, "return_tokens_as_token_ids": True}
    if streamed:
        choices, _ = stream(client, chat, **fields)
    else:
        choices = answer(client, chat, **fields)[0]["choices"]
    ids = _choice_tokens(choices)
    if chat:
        content = [entry for c in choices for entry in c["logprobs"]["content"]]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        tops = [top["token"] for e in content for top in e["top_logprobs"]]
    else:
        assert [t for c in choices for t in c["logprobs"]["tokens"]] == [
            f"token_id:{t}" for t in ids
        ]
        tops = [key for c in choices for top in c["logprobs"]["top_logprobs"] for key in top]
    assert len(tops) == 2 * len(ids) and all(t.startswith("token_id:") for t in tops)
    assert all(int(t.removeprefix("token_id:")) >= 0 for t in tops)


@BOTH
def test_prompt_logprobs_have_vllms_shape_and_the_engines_values(client, engine, chat):
    body, _ = answer(client, chat, prompt_logprobs=2)
    ids = body["prompt_token_ids"] if chat else body["choices"][0]["prompt_token_ids"]
    scored = body["prompt_logprobs"] if chat else body["choices"][0]["prompt_logprobs"]
    expected = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert len(scored) == len(ids) and scored[0] is None
    for position in range(1, len(ids)):
        entry, want = scored[position], expected.prompt_logprobs[position]
        assert next(iter(entry)) == str(ids[position])  # the prompt's token first
        assert set(entry) == {str(t) for t in want}
        for token, logprob in want.items():
            got = entry[str(token)]
            assert math.isclose(got["logprob"], logprob.logprob, rel_tol=1e-6)
            assert got["rank"] == logprob.rank and isinstance(got["decoded_token"], str)


@BOTH
def test_prompt_logprobs_with_stream_is_refused_as_vllm_refuses_it(client, chat):
    error = refused(client, chat, stream=True, prompt_logprobs=1)
    assert error["param"] == "prompt_logprobs" and "stream" in error["message"]


@BOTH
@STREAMED
def test_logit_bias_changes_the_greedy_choice(client, chat, streamed):
    plain = answer(client, chat)[0]["choices"][0]["token_ids"]
    favoured = (plain[0] + 11) % 256
    fields = {"logit_bias": {str(favoured): 100}}
    if streamed:
        ids = _choice_tokens(stream(client, chat, **fields)[0])
    else:
        ids = answer(client, chat, **fields)[0]["choices"][0]["token_ids"]
    assert ids == [favoured] * 6 != plain


@STREAMED
@pytest.mark.parametrize("prompt", [PROMPT, [256, 72, 105]], ids=["text", "token-ids"])
def test_echo_leads_the_text_and_the_logprobs_with_the_prompt(client, engine, streamed, prompt):
    fields = {"prompt": prompt, "echo": True, "logprobs": 1}
    plain = answer(client, prompt=prompt, logprobs=1)[0]["choices"][0]
    if streamed:
        choices, _ = stream(client, **fields)
        text = "".join(c["text"] for c in choices)
        logprobs = {key: [v for c in choices for v in c["logprobs"][key]] for key in
                    ("tokens", "token_logprobs", "top_logprobs", "text_offset")}  # fmt: skip
    else:
        choice = answer(client, **fields)[0]["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    ids = plain["prompt_token_ids"]
    echoed = PROMPT if prompt == PROMPT else "Hi"
    assert text == echoed + plain["text"]
    scored = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert logprobs["tokens"][len(ids) :] == plain["logprobs"]["tokens"]
    assert len(logprobs["tokens"]) == len(ids) + len(plain["token_ids"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(ids)):
        want = scored.prompt_logprobs[position][ids[position]].logprob
        assert math.isclose(logprobs["token_logprobs"][position], want, rel_tol=1e-6)
    # Not bit for bit: the echoing request computed its whole prompt, the plain one took a
    # cached prefix.
    assert logprobs["token_logprobs"][len(ids) :] == pytest.approx(
        plain["logprobs"]["token_logprobs"], rel=1e-5
    )
    offsets = logprobs["text_offset"]
    assert offsets[: len(ids)] == sorted(offsets[: len(ids)]) and offsets[len(ids) - 1] < len(
        echoed
    )
    assert offsets[len(ids) :] == [len(echoed) + o for o in plain["logprobs"]["text_offset"]]


@BOTH
def test_a_bad_logit_bias_is_a_400_naming_it(client, chat):
    assert refused(client, chat, logit_bias={"abc": 1})["param"] == "logit_bias"
    assert refused(client, chat, logit_bias={"5": 250})["param"] == "logit_bias"
    assert refused(client, chat, logit_bias={"999999": 1})["param"] == "logit_bias"


@BOTH
@STREAMED
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, chat, streamed):
    whole = answer(client, chat)[0]
    full = whole["prompt_token_ids"] if chat else whole["choices"][0]["prompt_token_ids"]
    if streamed:
        choices, _ = stream(client, chat, truncate_prompt_tokens=4)
        kept = choices[0]["prompt_token_ids"]
    else:
        body = answer(client, chat, truncate_prompt_tokens=4)[0]
        kept = body["choices"][0]["prompt_token_ids"]
        assert body["usage"]["prompt_tokens"] == 4
    assert kept == full[-4:]


@BOTH
@STREAMED
def test_cache_salt_shares_cached_prefixes_only_within_a_salt(client, chat, streamed):
    blocks = client.app.state.serve.engine.engine.scheduler.block_manager
    long = (
        {"prompt": "x" * 60} if not chat else {"messages": [{"role": "user", "content": "x" * 60}]}
    )

    def hits(salt):
        before = blocks.num_prefix_hit_tokens
        fields = {**long, "cache_salt": f"{salt}-{chat}-{streamed}"}
        stream(client, chat, **fields) if streamed else answer(client, chat, **fields)
        return blocks.num_prefix_hit_tokens - before

    assert hits("a") == 0
    assert hits("a") > 0
    assert hits("b") == 0


def _templated_client():
    app = _app()
    source = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
        "{% if m.tool_calls %}[calls:{{ m.tool_calls | map(attribute='function.name') | join(',') }}]"
        "{% endif %}{% endfor %}"
        "{% if tools %}[tools:{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
        "{% if enable_thinking %}[think]{% endif %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    app.state.serve.engine.engine.input_processor.chat_template = ChatTemplate(source)
    return TestClient(app)


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


@STREAMED
def test_chat_template_fields_reach_the_template(streamed):
    tools = TOOLS
    cases = [
        ({}, "[user]hi[assistant]"),
        ({"add_generation_prompt": False}, "[user]hi"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "[user]hi[think][assistant]"),
        ({"tools": tools, "tool_choice": "auto"}, "[user]hi[tools:lookup][assistant]"),
        ({"tools": tools, "tool_choice": "none"}, "[user]hi[tools:lookup][assistant]"),
        (
            {"messages": [*MESSAGES, {"role": "assistant", "content": "Hel"}],
             "add_generation_prompt": False, "continue_final_message": True},
            "[user]hi[assistant]Hel",
        ),
    ]  # fmt: skip
    with _templated_client() as client:
        for fields, text in cases:
            if streamed:
                ids = stream(client, True, **fields)[0][0]["prompt_token_ids"]
            else:
                ids = answer(client, True, **fields)[0]["prompt_token_ids"]
            assert bytes(ids).decode() == text, fields


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice", "not supported"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
         "demands a tool call"),
        ({"continue_final_message": True}, "continue_final_message", "exclude each other"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set"),
        ({"chat_template": "{{ messages }}"}, "chat_template", "not supported"),
        ({"echo": True}, "echo", "not supported"),
    ],
)  # fmt: skip
def test_chat_fields_that_cannot_be_honoured_are_400s_naming_them(client, fields, param, says):
    error = refused(client, True, **fields)
    assert error["param"] == param and says in error["message"]


@BOTH
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"priority": 1}, "priority"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"best_of": 3}, "best_of"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"truncation_side": "right", "truncate_prompt_tokens": 2}, "truncation_side"),
    ],
)
def test_vllm_fields_that_change_the_answer_are_honoured_or_refused_by_name(
    client, chat, fields, param
):
    error = refused(client, chat, **fields)
    assert error["param"] == param and "not supported" in error["message"]


@pytest.mark.parametrize("fields", [{"suffix": "end"}, {"prompt_embeds": "AAAA"}])
def test_completion_only_fields_that_cannot_be_honoured_are_refused(client, fields):
    error = refused(client, **fields)
    assert error["param"] == next(iter(fields)) and "not supported" in error["message"]


@BOTH
@pytest.mark.parametrize(
    "fields",
    [{"priority": 0}, {"response_format": {"type": "text"}}, {"best_of": 1},
     {"use_beam_search": False}, {"structured_outputs": None}],
)  # fmt: skip
def test_the_defaults_of_refused_fields_are_taken(client, chat, fields):
    body, headers = answer(client, chat, **fields)
    assert len(body["choices"][0]["token_ids"]) == 6 and HEADER not in headers


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2}),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 2}),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"prompt_logprobs": 2, "logprobs": 2}},
        ),
    ],
    ids=["prompt-logprobs", "echo", "chat", "generate"],
)
def test_a_non_finite_logprob_is_written_as_vllms_lowest_not_a_500(route, fields):
    # A policy whose training diverged serves NaN logits; the answer must still be JSON.
    engine = AsyncEngine("debug", engine_config=EngineConfig(num_kv_blocks=32))
    with torch.no_grad():
        engine.engine.model.lm_head.weight.fill_(float("nan"))
    engine.engine.model.repack_linears()  # written outside an update: the packed copy follows
    with TestClient(create_app(engine, ServerConfig(model_name="debug"))) as client:
        response = client.post(route, json={**fields, "max_tokens": 2})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["finish_reason"] for c in answer["choices"]] == ["error"]
    assert -9999.0 in _floats(answer)  # each NaN prompt log-probability, as vLLM writes -inf


def _floats(tree):
    if isinstance(tree, float):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else []
    return [f for value in values for f in _floats(value)]
