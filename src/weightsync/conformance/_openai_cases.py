"""Cases of the OpenAI routes: the fields an RL client sends, the token ids it reads, bad inputs.

A sampling field passes when the server honours it, or refuses it with a typed 400 that names
it (a field silently ignored could change the output unnoticed). Where a field's effect can be
seen on any model, the case checks it (top_k=1 and min_p=1 sample the greedy tokens).
"""

from __future__ import annotations

import json
from typing import Any

from weightsync.conformance._case import Case, Run
from weightsync.conformance._pause_cases import prompt
from weightsync.conformance._probe import (
    Answer,
    CaseFailed,
    CaseSkipped,
    Probe,
    expect_ok,
    expect_refusal,
    token_ids,
)


def _choices(answer: Answer) -> list[dict[str, Any]]:
    choices = expect_ok(answer, choices=...)["choices"]
    if not isinstance(choices, list) or not choices:
        raise CaseFailed(f"no choices: {answer.describe()}")
    return choices


def _taken_or_refused(answer: Answer, name: str) -> str | None:
    """None when the field was taken (200); a detail when refused as not supported, by name.

    Raises:
        CaseFailed: Any other answer, or a refusal that does not say the field is unsupported
            (an "unknown field" reads as a typo, not as a missing feature).
    """
    if answer.status == 200:
        return None
    detail = expect_refusal(answer, (400, 422), mentions=name)
    if "support" not in answer.error_message().lower():
        raise CaseFailed(f"refused without saying {name} is not supported: {detail}")
    return "refused: " + detail


def _greedy(probe: Probe, seed: int, max_tokens: int = 8) -> list[int]:
    answer = probe.completion(prompt=prompt(seed), max_tokens=max_tokens, return_token_ids=True)
    try:
        return token_ids(answer)
    except CaseFailed as exc:
        raise CaseSkipped(f"needs return_token_ids ({exc})") from None


def _basic(probe: Probe) -> str:
    answer = probe.completion(prompt=prompt(30), max_tokens=4)
    body = expect_ok(answer, id=..., object="text_completion", usage=...)
    choice, usage = _choices(answer)[0], body["usage"]
    # A model may end with EOS before max_tokens: 'stop' then, with fewer tokens.
    reason, generated = choice.get("finish_reason"), usage.get("completion_tokens")
    if not isinstance(choice.get("text"), str) or reason not in ("length", "stop"):
        raise CaseFailed(f"expected text and finish_reason 'length' or 'stop': {answer.describe()}")
    if not (
        generated == 4 if reason == "length" else isinstance(generated, int) and generated <= 4
    ):
        raise CaseFailed(f"usage {usage} for 4 tokens at most, and finish_reason {reason!r}")
    if usage.get("prompt_tokens") != len(prompt(30)):
        raise CaseFailed(f"usage {usage} for a {len(prompt(30))}-token prompt")
    return f"text, finish_reason {reason!r}, usage {usage}"


def _return_token_ids(probe: Probe) -> str:
    answer = probe.completion(prompt=prompt(31), max_tokens=6, return_token_ids=True)
    ids = token_ids(answer)
    choice = _choices(answer)[0]
    generated = (answer.body.get("usage") or {}).get("completion_tokens")
    if not ids or len(ids) != generated or choice.get("prompt_token_ids") != prompt(31):
        raise CaseFailed(
            f"token_ids {ids} for {generated} completion tokens; prompt_token_ids "
            f"{choice.get('prompt_token_ids')} for the prompt {prompt(31)}"
        )
    return f"choices[0].token_ids ({len(ids)}) and choices[0].prompt_token_ids (the prompt)"


def _stream_token_ids(probe: Probe) -> str:
    expected = _greedy(probe, 32, 6)
    body = {"model": probe.model, "prompt": prompt(32), "max_tokens": 6, "temperature": 0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    answer = probe.call("POST", "/v1/completions", json_body=body)
    if answer.status != 200 or not isinstance(answer.body, str):
        raise CaseFailed(f"expected a 200 event stream, got {answer.describe()}")
    streamed: list[int] = []
    for line in answer.body.split("\n"):  # not splitlines: text may hold U+2028
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            for choice in json.loads(line[5:]).get("choices") or []:
                streamed += choice.get("token_ids") or []
    if streamed != expected:
        raise CaseFailed(f"streamed token_ids {streamed} differ from greedy {expected}")
    return "the chunks' token_ids are the greedy completion's"


def _chat_basic(probe: Probe) -> str:
    answer = probe.chat()
    expect_ok(answer, object="chat.completion")
    message = _choices(answer)[0].get("message") or {}
    if message.get("role") != "assistant" or not isinstance(message.get("content"), str):
        raise CaseFailed(f"expected an assistant message: {answer.describe()}")
    return "an assistant message"


def _chat_token_ids(probe: Probe) -> str:
    answer = probe.chat(return_token_ids=True)
    ids = token_ids(answer)
    prompt_ids = answer.body.get("prompt_token_ids")
    if not isinstance(prompt_ids, list) or not prompt_ids:
        raise CaseFailed(f"no top-level prompt_token_ids: {answer.describe()}")
    return f"choices[0].token_ids ({len(ids)}) and a top-level prompt_token_ids"


def _same_as_greedy(name: str, value: Any) -> Run:
    """`name=value` at temperature 1 keeps only the most likely token: greedy's tokens."""

    def run(probe: Probe) -> str:
        seed = 40 + len(name)
        expected = _greedy(probe, seed)
        _require_one_most_likely(probe, seed)
        answer = probe.completion(prompt=prompt(seed), temperature=1.0, seed=3,
                                  return_token_ids=True, **{name: value})  # fmt: skip
        if refused := _taken_or_refused(answer, name):
            return refused
        if token_ids(answer) != expected:
            raise CaseFailed(f"{name}={value} at temperature 1 sampled {token_ids(answer)}, "
                             f"not the greedy {expected}: the field was ignored")  # fmt: skip
        return f"{name}={value} samples the greedy tokens"

    return run


def _require_one_most_likely(probe: Probe, seed: int) -> None:
    """Skips the case unless each greedy step has one most likely token (zero weights tie all)."""
    answer = probe.completion(prompt=prompt(seed), max_tokens=8, logprobs=2)
    tops = (_choices(answer)[0].get("logprobs") or {}).get("top_logprobs") or []
    for step, top in enumerate(tops):
        values = sorted((top or {}).values(), reverse=True)
        if len(values) < 2 or values[0] - values[1] < 1e-6:
            raise CaseSkipped(f"greedy step {step} has no single most likely token ({top}): "
                              "any of the tied tokens is right")  # fmt: skip


def _stop_token_ids(probe: Probe) -> str:
    expected = _greedy(probe, 50)
    # The first token that has not come before: the completion stops there.
    cut = next((i for i in range(1, len(expected)) if expected[i] not in expected[:i]), None)
    if cut is None:
        raise CaseSkipped(f"greedy output {expected} repeats one token")
    answer = probe.completion(prompt=prompt(50), stop_token_ids=[expected[cut]],
                              return_token_ids=True)  # fmt: skip
    if refused := _taken_or_refused(answer, "stop_token_ids"):
        return refused
    got, choice = token_ids(answer), _choices(answer)[0]
    if choice.get("finish_reason") != "stop" or got[:cut] != expected[:cut] or len(got) > cut + 1:
        raise CaseFailed(f"stop_token_ids=[{expected[cut]}] gave {got} ({choice.get('finish_reason')}); "
                         f"greedy is {expected}")  # fmt: skip
    return f"stopped at token {cut} with finish_reason 'stop'"


def _taken(name: str, value: Any, **extra: Any) -> Run:
    def run(probe: Probe) -> str:
        answer = probe.completion(prompt=prompt(60), **{name: value, **extra})
        if refused := _taken_or_refused(answer, name):
            return refused
        _choices(answer)
        return f"{name}={value!r} taken"

    return run


def _seed(probe: Probe) -> str:
    runs = [probe.completion(prompt=prompt(61), temperature=1.0, seed=11, max_tokens=16)
            for _ in range(2)]  # fmt: skip
    first, second = (_choices(answer)[0].get("text") for answer in runs)
    if first != second:
        raise CaseFailed(f"seed 11 sampled {first!r}, then {second!r}")
    return "the same seed samples the same text"


def _n(probe: Probe) -> str:
    answer = probe.completion(prompt=prompt(62), temperature=1.0, n=2, seed=1)
    indexes = sorted(int(choice.get("index", -1)) for choice in _choices(answer))
    if indexes != [0, 1]:
        raise CaseFailed(f"n=2 gave choices {indexes}")
    return "two choices, index 0 and 1"


def _logprobs(probe: Probe) -> str:
    answer = probe.completion(prompt=prompt(63), max_tokens=4, logprobs=2)
    logprobs = _choices(answer)[0].get("logprobs") or {}
    values, tops = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    generated = (answer.body.get("usage") or {}).get("completion_tokens")  # 4, unless EOS came
    if (
        not isinstance(values, list)
        or not values
        or len(values) != generated
        or not (isinstance(tops, list) and len(tops) == generated)
    ):
        raise CaseFailed(f"expected token_logprobs and top_logprobs for each of {generated} "
                         f"tokens: {answer.describe()}")  # fmt: skip
    return f"token_logprobs and top_logprobs for each of {generated} tokens"


def _unknown_field(probe: Probe) -> str:
    answer = probe.completion(prompt=prompt(64), max_tokens=2, conformance_unknown_field=1)
    if answer.status == 200:  # vLLM's rule: ignored (and logged) by the server
        _choices(answer)
        return "ignored, as vLLM ignores it"
    return "refused: " + expect_refusal(answer, (400, 422), mentions="conformance_unknown_field")


def _bad(statuses: tuple[int, ...], mentions: str, **fields: Any) -> Run:
    def run(probe: Probe) -> str:
        answer = probe.completion(**{"prompt": prompt(65), **fields})
        return expect_refusal(answer, statuses, mentions=mentions)

    return run


CASES = [
    Case("completions.basic", "text, finish_reason and usage as OpenAI's", _basic),
    Case(
        "completions.return_token_ids",
        "return_token_ids adds choices[0].token_ids and choices[0].prompt_token_ids",
        _return_token_ids,
    ),
    Case(
        "completions.stream_token_ids",
        "streamed with return_token_ids, the chunks' token_ids are the greedy completion's",
        _stream_token_ids,
    ),
    Case("chat.basic", "an assistant message", _chat_basic),
    Case(
        "chat.return_token_ids",
        "return_token_ids adds choices[0].token_ids and a top-level prompt_token_ids",
        _chat_token_ids,
    ),
    Case(
        "completions.top_k",
        "top_k=1 samples the greedy tokens (or a typed 400 saying it is not supported)",
        _same_as_greedy("top_k", 1),
    ),
    Case(
        "completions.min_p",
        "min_p=1 samples the greedy tokens (or a typed 400 saying it is not supported)",
        _same_as_greedy("min_p", 1.0),
    ),
    Case(
        "completions.stop_token_ids", "a stop token id ends the completion there", _stop_token_ids
    ),
    Case("completions.seed", "one seed samples the same tokens twice", _seed),
    Case("completions.n", "n=2 gives two choices", _n),
    Case("completions.logprobs", "logprobs gives token_logprobs and top_logprobs", _logprobs),
    *(
        Case(
            f"completions.{name}",
            f"{name} is taken, or refused by a typed 400 saying it is not supported",
            _taken(name, value),
        )
        for name, value in (
            ("repetition_penalty", 1.2),
            ("presence_penalty", 0.5),
            ("frequency_penalty", 0.5),
            ("min_tokens", 2),
            ("ignore_eos", True),
            ("skip_special_tokens", False),
            ("include_stop_str_in_output", True),
        )
    ),
    Case(
        "completions.unknown_field",
        "a field no client sends is ignored (vLLM's rule) or refused by a typed 400 naming it",
        _unknown_field,
        note="vLLM ignores unknown fields and logs them; `weightsync serve` does the same and "
        "names them in X-Ignored-Fields, or refuses them with --strict-request-fields",
    ),
    Case(
        "completions.bad_temperature",
        "temperature -1 is a typed 400",
        _bad((400, 422), "temperature", temperature=-1),
    ),
    Case(
        "completions.bad_max_tokens",
        "max_tokens 0 is a typed 400",
        _bad((400, 422), "max_tokens", max_tokens=0),
    ),
    Case(
        "completions.too_long",
        "max_tokens beyond the model's length is a typed 400",
        _bad((400, 422), "max_tokens", max_tokens=10**7),
    ),
    Case(
        "completions.out_of_vocabulary",
        "a prompt token id beyond the vocabulary is a typed 400",
        _bad((400, 422), "", prompt=[1, 10**9]),
    ),
    Case(
        "completions.unknown_model",
        "an unknown model is a typed 404",
        _bad((404,), "model", model="conformance-no-such-model"),
    ),
]
