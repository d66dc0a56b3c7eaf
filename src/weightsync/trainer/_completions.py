"""Completion requests and answers as the trainer's client reads them: bodies, stream chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync.engine.outputs import CompletionOutput, RequestOutput
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Prompt


def completion_body(
    prompts: Sequence[Prompt],
    params: SamplingParams,
    request_id: str | None,
    stream: bool,
) -> dict[str, Any]:
    """The `/v1/completions` body of `prompts` sampled with `params` (every field of it)."""
    body: dict[str, Any] = {
        "prompt": [p if isinstance(p, str) else list(p) for p in prompts],
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "seed": params.seed,
        "stop": params.stop or None,
        "stop_token_ids": params.stop_token_ids or None,
        "ignore_eos": params.ignore_eos,
        "min_tokens": params.min_tokens,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "logprobs": params.logprobs,
        "stream": stream,
    }
    if request_id is not None:
        body["request_id"] = request_id
    return body


def accumulate(total: dict[str, Any] | None, delta: dict[str, Any]) -> dict[str, Any]:
    """Adds a stream chunk's choice to the choice so far."""
    if total is None:
        total = {"text": "", "token_ids": [], "weight_versions": [], "logprobs": None}
    total["text"] += delta.get("text", "")
    total["token_ids"] += delta.get("token_ids", [])
    total["weight_versions"] += delta.get("weight_versions", [])
    if delta.get("logprobs") is not None:
        previous = total["logprobs"] or {"token_logprobs": [], "top_logprobs": []}
        previous["token_logprobs"] += delta["logprobs"]["token_logprobs"]
        previous["top_logprobs"] += delta["logprobs"]["top_logprobs"]
        total["logprobs"] = previous
    for key in ("prompt_token_ids", "finish_reason", "stop_reason", "index"):
        if delta.get(key) is not None:
            total[key] = delta[key]
    return total


def to_output(
    completion_id: str, choice: dict[str, Any], prompts: Sequence[Prompt]
) -> RequestOutput:
    """A `RequestOutput` from one choice of a completion answer."""
    index = int(choice.get("index", 0))
    logprobs = choice.get("logprobs")
    prompt = prompts[index] if index < len(prompts) else None
    completion = CompletionOutput(
        index=0,
        text=choice["text"],
        token_ids=list(choice["token_ids"]),
        weight_versions=list(choice["weight_versions"]),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        logprobs=None if logprobs is None else list(logprobs["token_logprobs"]),
    )
    return RequestOutput(
        request_id=f"{completion_id}-{index}",
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=list(choice.get("prompt_token_ids", [])),
        outputs=[completion],
        finished=completion.finish_reason is not None,
    )
