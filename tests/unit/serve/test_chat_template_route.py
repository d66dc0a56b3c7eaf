"""`/v1/chat/completions` renders the served model's own chat template (in process)."""

from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient

from weightsync import AsyncEngine, EngineConfig
from weightsync.serve import ServerConfig, create_app

transformers = pytest.importorskip("transformers")


def serve(path):
    engine = AsyncEngine(str(path), engine_config=EngineConfig(num_kv_blocks=64, block_size=8))
    return TestClient(create_app(engine, ServerConfig(model_name="m")))


def test_chat_prompts_are_the_models_template_as_transformers_renders_it(family_dir):
    path = family_dir("qwen3")
    parts = [{"type": "text", "text": "Héllo "}, {"type": "text", "text": "🤖"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    expected = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        [messages[0], {"role": "user", "content": "Héllo 🤖"}], add_generation_prompt=True
    )
    with serve(path) as client:
        answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["prompt_token_ids"] == list(expected["input_ids"])


def test_messages_the_template_refuses_are_a_400_naming_it(family_dir, tmp_path):
    path = shutil.copytree(family_dir("llama2"), tmp_path / "llama2")
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with serve(path) as client:
        answer = client.post("/v1/chat/completions", json={"messages": messages})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages" and error["type"] == "InvalidRequestError"
    assert error["message"].endswith(
        "chat_template.jinja refused the messages: Conversation roles must alternate "
        "user/assistant/user/assistant"
    )
