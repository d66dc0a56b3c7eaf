"""The chat template: a model's own renders what `transformers` renders, in a sandbox; a model
without one gets the documented default."""

from __future__ import annotations

import json
import re
import shutil

import jinja2
import jinja2.sandbox
import pytest
from engine_helpers import small_config

from model_dirs import FAMILIES
from weightsync.engine.chat_template import ChatTemplate
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.tokenizer import ByteTokenizer
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


@pytest.mark.parametrize(
    "source",
    ["{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "{% if 1 %}" * 200 + "x" + "{% endif %}" * 200],
    ids=["nested-expression", "nested-blocks"],
)
def test_a_template_nested_too_deeply_is_refused_at_load_naming_it(source):
    with pytest.raises(
        EngineConfigError, match=r"^my\.jinja is not a valid Jinja template: it nests"
    ):
        ChatTemplate(source, origin="my.jinja")


def test_a_template_longer_than_any_chat_template_is_refused_before_compiling():
    # Compiling this would take about 40 s; refused from its length at once.
    source = "{{ messages[0].content }}" * 2**18
    with pytest.raises(EngineConfigError, match=r"^my\.jinja is \d+ characters, more than the"):
        ChatTemplate(source, origin="my.jinja")


def test_named_templates_whose_names_are_not_texts_are_skipped(tmp_path):
    config = {"chat_template": [{"name": ["default"], "template": "{{ 1 }}"},
                                {"name": {"a": 1}, "template": "{{ 2 }}"},
                                {"name": "default", "template": "{{ 3 }}"}]}  # fmt: skip
    template = ChatTemplate.from_directory(tmp_path, config, {})
    assert template is not None
    assert template.render([]) == "3"


class _RecordingTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template of the test's, recording each text it encodes."""

    def __init__(self, template: str) -> None:
        super().__init__()
        self.chat_template = ChatTemplate(template, origin="chat_template.jinja")
        self.encoded: list[int] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens=add_special_tokens)


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_template_that_loops_past_its_deadline_is_refused_naming_the_limit():
    # Two nested loops that the sandbox's cap on one range lets through: 10^10 iterations.
    template = ChatTemplate(NESTED_LOOPS + "{{ messages[0].content }}", origin="t.jinja")
    with pytest.raises(InvalidRequestError) as caught:
        template.render([{"role": "user", "content": "x"}], timeout_s=0.2)
    assert str(caught.value).startswith(
        "t.jinja passed its time bound on these messages: rendering took longer than its limit "
        "of 0.2 s"
    )


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("{{ messages[0].content * 20000000 }}", "str * 20000000 reaches 40000000"),
        ("{% for i in range(100000) %}{{ messages[0].content * 64 }}{% endfor %}",
         "the rendered prompt reaches 16512"),
        ("{% set ns = namespace(s=messages[0].content) %}{% for i in range(64) %}"
         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "a concatenated text reaches 32768"),
        ("{% set ns = namespace(s=messages[0].content) %}{% for i in range(64) %}"
         "{% set ns.s = ns.s + ns.s %}{% endfor %}", "a sum of texts or lists reaches 32768"),
        ("{{ [messages] * 10**6 }}", "list * 1000000 reaches 1000000"),
        ("{{ '%999999999s' % 1 }}", "a format width reaches 999999999"),
        ("{{ '{:>999999999}'.format(1) }}", "a format width reaches 999999999"),
        ("{{ ('{0}' * 5000).format(messages[0].content * 4) }}", "a formatted text reaches"),
        ("{{ messages[0].content.ljust(10**9) }}", "an integer argument (a width, a count) "
         "reaches 1000000000"),
        ("{{ (messages[0].content * 4000).replace('', messages[0].content * 4000) }}",
         "a replaced text reaches 64016000"),
        ("{{ range(100000) | join(messages[0].content * 1000) }}", "a joined text reaches"),
        ("{{ ((messages[0].content ~ '\\n') * 3000) | indent(1000) }}",
         "an indented text reaches 3010000"),
    ],
    ids=["repeat-20000000", "output", "double-by-concat", "double-by-plus", "list-repeat",
         "percent-width", "format-width", "format-fields", "ljust", "replace", "join", "indent"],
)  # fmt: skip
def test_a_template_that_passes_the_size_bound_is_refused_before_encoding(source, what):
    tokenizer = _RecordingTokenizer(source)
    engine = LLMEngine("debug", engine_config=small_config(), tokenizer=tokenizer)
    limit = engine.max_model_len * 32
    with pytest.raises(InvalidRequestError) as caught:
        engine.apply_chat_template([{"role": "user", "content": "ab"}])
    message = str(caught.value)
    assert message.startswith("chat_template.jinja passed its size bound on these messages: ")
    assert what in message
    assert f"past the size limit of {limit} characters" in message
    assert tokenizer.encoded == []  # nothing reached the tokenizer


def test_a_template_that_computes_a_huge_integer_is_refused_before_computing_it():
    template = ChatTemplate("{{ 10 ** (10 ** 8) }}", origin="t.jinja")
    with pytest.raises(
        InvalidRequestError,
        match=r"^t\.jinja passed its size bound on these messages: an integer of about "
        r"400000000 bits would pass the limit of 4096 bits",
    ):
        template.render([{"role": "user", "content": "x"}])


def test_a_template_within_its_bounds_renders_what_an_unbounded_sandbox_renders():
    source = (
        "{% for message in messages %}{% for i in range(3) %}{{ message.content * 2 ~ i }}"
        "{% endfor %}{{ '%s|%5s' % (message.role, 'x') }}{{ [message.content] | join(',') }}"
        "{{ 'a-b'.replace('-', '+') }}{{ '{:>4}'.format(loop.index) }}{{ message | tojson }}"
        "{% endfor %}"
    )
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = json.dumps
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = ChatTemplate(source).render(messages)
    assert rendered == plain.from_string(source).render(messages=messages)
    assert rendered.startswith('hihi0hihi1hihi2user|    xhia+b   1{"role": "user"')


def test_a_text_longer_than_can_be_served_is_refused_before_encoding():
    tokenizer = _RecordingTokenizer("{{ messages[0].content }}")
    engine = LLMEngine("debug", engine_config=small_config(), tokenizer=tokenizer)
    limit = engine.max_model_len * 32
    with pytest.raises(
        InvalidRequestError,
        match=rf"prompt has {limit + 1} characters, more than the limit of {limit} "
        rf"\(max_model_len {engine.max_model_len} x 32\)",
    ):
        engine.tokenize("x" * (limit + 1))
    # A conversation's text is bounded while it renders, with the same limit.
    with pytest.raises(
        InvalidRequestError, match=rf"the rendered prompt reaches {limit + 1}, past the size limit"
    ):
        engine.apply_chat_template([{"role": "user", "content": "x" * (limit + 1)}])
    assert tokenizer.encoded == []
    with pytest.raises(InvalidRequestError, match="prompt has 16385 tokens but max_model_len"):
        engine.tokenize("x" * limit)  # at the limit: encoded, then refused by its tokens
    assert tokenizer.encoded == [limit]


def test_a_directorys_template_has_the_same_bounds(family_dir, tmp_path):
    path = shutil.copytree(family_dir("qwen2"), tmp_path / "qwen2")
    (path / "chat_template.jinja").write_text("{{ messages[0].content * 20000000 }}")
    engine = LLMEngine(str(path), engine_config=small_config())
    with pytest.raises(InvalidRequestError, match=r"chat_template\.jinja passed its size bound"):
        engine.apply_chat_template([{"role": "user", "content": "ab"}])
