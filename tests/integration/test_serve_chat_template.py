"""A hostile chat template in a checkpoint directory: `weightsync serve` keeps serving everyone.

The directory's `chat_template.jinja` renders an ordinary ChatML prompt, except for two
messages: `loop` runs two nested `range(100000)` loops (10^10 iterations), `repeat` repeats the
message twenty million times. The render runs off the event loop and within its bounds (5 s, and
`max_model_len x 32` characters), so `/health` and other completions are answered while it runs,
and the conversation itself gets a 400 that names the bound and its limit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from replica_support import wait_for
from serve_support import Server

from model_dirs import CHATML, write_model_dir

pytestmark = pytest.mark.reliability("bad-input")

TIMEOUT_S = 60.0
HOSTILE = (
    "{% if messages[0].content == 'loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0].content == 'repeat' %}{{ messages[0].content * 20000000 }}"
    "{% else %}" + CHATML + "{% endif %}"
)
SIZE_LIMIT = 512 * 32  # the test model's max_position_embeddings x characters per token


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path: Path = write_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2")
    (path / "chat_template.jinja").write_text(HOSTILE)
    server = Server(str(path), "--port", "0", "--num-kv-blocks", "64")
    try:
        yield server
    finally:
        server.kill()


def chat(server: Server, content: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def stats(server: Server) -> dict[str, Any]:
    answer = httpx.get(f"{server.base_url}/engine_stats", timeout=10)
    answer.raise_for_status()
    return dict(answer.json())


def assert_serving(server: Server) -> None:
    """`/health`, a completion and an ordinary conversation are answered."""
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    completion = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": "The quick", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=TIMEOUT_S,
    )
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"][0]["token_ids"]) == 4
    conversation = chat(server, "Hi there")
    assert conversation.status_code == 200, conversation.text
    assert conversation.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_template_that_loops_for_ever_is_cut_at_its_deadline_while_others_are_served(server):
    """A template running 10^10 loop iterations: the others are served, it gets a 400 at 5 s."""
    answers: list[httpx.Response | BaseException] = []

    def hostile() -> None:
        try:
            answers.append(chat(server, "loop"))
        except BaseException as exc:  # reported by the assertion below
            answers.append(exc)

    thread = threading.Thread(target=hostile)
    thread.start()
    try:
        wait_for(lambda: stats(server)["num_rendering"] == 1)  # the render is in flight
        assert_serving(server)
    finally:
        thread.join(TIMEOUT_S)
    (answer,) = answers
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "InvalidRequestError"
    assert error["param"] == "messages"
    assert (
        "chat_template.jinja passed its time bound on these messages: rendering took longer "
        "than its limit of 5 s" in error["message"]
    )
    assert stats(server)["num_rendering"] == 0
    assert_serving(server)


def test_a_template_that_repeats_the_message_is_refused_before_it_builds_the_prompt(server):
    """A template repeating the message 20,000,000 times: a 400 naming the size limit."""
    answer = chat(server, "repeat")
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages"
    assert (
        "chat_template.jinja passed its size bound on these messages: str * 20000000 reaches "
        f"120000000, past the size limit of {SIZE_LIMIT} characters" in error["message"]
    )
    assert_serving(server)
