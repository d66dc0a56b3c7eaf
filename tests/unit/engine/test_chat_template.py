"""The chat template: a model's own renders what `transformers` renders, in a sandbox; a model
without one gets the documented default."""

from __future__ import annotations

import json
import re
import shutil

import jinja2
import pytest
from engine_helpers import small_config

from model_dirs import FAMILIES
from weightsync.engine.chat_template import ChatTemplate
from weightsync.engine.llm_engine import LLMEngine
from weightsync.errors import EngineConfigError, InvalidRequestError

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there 🤖"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " 4 "},
        {"role": "user", "content": "And ünïcödé?\n  Indented."},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
    # Two user turns in a row: Llama 2's template refuses them (raise_exception), as it refuses
    # a system turn.
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
]  # fmt: skip


def hf_ids(hf, messages, add_generation_prompt):
    ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_models_template_renders_what_transformers_renders(
    family_dir, name, add_generation_prompt
):
    path = family_dir(name)
    engine = LLMEngine(str(path), engine_config=small_config())
    hf = transformers.AutoTokenizer.from_pretrained(path)
    refused = 0
    for messages in CONVERSATIONS:
        try:
            text = hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except jinja2.TemplateError as exc:  # the template's own refusal: ours refuses alike
            refused += 1
            with pytest.raises(InvalidRequestError, match=re.escape(str(exc))) as caught:
                engine.input_processor.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt
                )
            assert "chat_template.jinja refused the messages" in str(caught.value)
            continue
        rendered = engine.input_processor.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt
        )
        assert rendered == text
        ids = engine.input_processor.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        assert ids == hf_ids(hf, messages, add_generation_prompt)
    assert refused == (2 if name == "llama2" else 0)  # a system turn, two user turns


@pytest.mark.parametrize("form", ["text", "named-list"])
def test_a_template_in_tokenizer_config_json_is_read_too(family_dir, tmp_path, form):
    path = shutil.copytree(family_dir("qwen3"), tmp_path / "qwen3")
    source = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        source if form == "text" else [{"name": "tool_use", "template": "{{ 1 }}"},
                                       {"name": "default", "template": source}]
    )  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    engine = LLMEngine(str(path), engine_config=small_config())
    hf = transformers.AutoTokenizer.from_pretrained(path)
    messages = CONVERSATIONS[1]
    assert engine.apply_chat_template(messages) == hf_ids(hf, messages, True)
    assert "tokenizer_config.json: chat_template" in engine.input_processor.chat_template.origin


def test_a_directory_without_a_template_keeps_the_documented_default(family_dir, tmp_path):
    path = shutil.copytree(family_dir("llama3"), tmp_path / "llama3")
    (path / "chat_template.jinja").unlink()
    engine = LLMEngine(str(path), engine_config=small_config())
    ids = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    # The default's text, after the tokenizer's own special token (Llama 3's BOS).
    assert ids == engine.tokenizer.encode("<|user|>\nhi\n<|assistant|>\n")
    assert ids[0] == engine.tokenizer.bos_token_id


def test_the_default_template_is_the_documented_format():
    engine = LLMEngine("debug", engine_config=small_config())
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hé"}]
    text = "<|system|>\nS\n<|user|>\nhé\n<|assistant|>\n"
    assert engine.input_processor.chat_template.render(messages) == text
    assert engine.apply_chat_template(messages) == [256, *text.encode()]
    assert (
        engine.input_processor.chat_template.render(messages, add_generation_prompt=False)
        == text[:-14]
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "access to attribute '__class__'"),
        ("{{ messages.append(1) }}", "unsafe"),
        ("{{ messages[0].content.nope.deeper }}", "'str object' has no attribute 'nope'"),
        ("{{ raise_exception('no system messages') }}", "no system messages"),
    ],
    ids=["dunder", "mutation", "undefined", "raise-exception"],
)
def test_a_template_runs_in_a_sandbox_and_its_errors_are_the_requests(source, message):
    template = ChatTemplate(source, origin="tokenizer_config.json: chat_template")
    with pytest.raises(InvalidRequestError, match=message) as caught:
        template.render([{"role": "user", "content": "x"}])
    assert str(caught.value).startswith("tokenizer_config.json: chat_template ")


def test_a_template_that_is_not_jinja_is_refused_at_load():
    with pytest.raises(
        EngineConfigError, match=r"my\.jinja is not a valid Jinja template: .* \(line 2\)"
    ):
        ChatTemplate("ok\n{% if %}", origin="my.jinja")
