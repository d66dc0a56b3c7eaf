"""Bad input through the Python API, table-driven: each case is refused where it enters.

Every case runs while a request is in flight on the engine. It asserts the error's class and
message, then that nothing moved: the in-flight request finishes with exactly the tokens it
would have had without the case, and the weights and their version are as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from engine_helpers import SOURCES, LocalSource, greedy, make_engine

from weightsync import EngineConfig, SamplingParams, WeightTransferConfig
from weightsync.errors import (
    EngineBusyError,
    EngineConfigError,
    InvalidRequestError,
    WeightSyncError,
    WeightUpdateStateError,
    WeightValidationError,
)

pytestmark = pytest.mark.reliability("bad-input")

IN_FLIGHT_TOKENS = 10


@dataclass(frozen=True)
class Case:
    """One bad input: what is called, and the error it must raise."""

    id: str
    call: Callable[[Any], Any]
    error: type[WeightSyncError]
    message: str


def paused(call: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Runs `call` on a paused engine (an update's validation is only reached there)."""

    def run(ctx: Any) -> Any:
        ctx.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            return call(ctx)
        finally:
            ctx.engine.resume_generation()

    return run


def add(prompt: Any = "hi", **params: Any) -> Callable[[Any], Any]:
    return lambda ctx: ctx.engine.add_request(
        f"bad-{ctx.count()}", prompt, SamplingParams(**params) if params else None
    )


def update(info: dict[str, Any]) -> Callable[[Any], Any]:
    return paused(lambda ctx: ctx.engine.update_weights({"update_info": info}))


def info(**overrides: Any) -> dict[str, Any]:
    base = {"names": ["model.norm.weight"], "dtype_names": ["float64"], "shapes": [[64]]}
    return {**base, **overrides}


def sampling(**params: Any) -> Case:
    field = next(iter(params))
    value = params[field]
    label = "nan" if isinstance(value, float) and math.isnan(value) else repr(value)
    return Case(f"sampling-{field}={label}", add(**params), InvalidRequestError, field)


CASES = [
    # SamplingParams: each field, out of range or of the wrong type.
    sampling(max_tokens=0),
    sampling(max_tokens=-3),
    sampling(max_tokens=True),
    sampling(max_tokens=2.5),
    sampling(temperature=-0.1),
    sampling(temperature=math.nan),
    sampling(temperature=math.inf),
    sampling(temperature="1"),
    sampling(top_p=0),
    sampling(top_p=1.5),
    sampling(top_p=math.nan),
    sampling(seed=2**64),
    sampling(seed=-(2**63) - 1),
    sampling(seed=True),
    sampling(seed=1.5),
    sampling(stop=[""]),
    sampling(stop=[7]),
    sampling(stop_token_ids=[-1]),
    sampling(stop_token_ids=["a"]),
    sampling(logprobs=21),
    sampling(logprobs=True),
    sampling(logprobs=-1),
    # Stop lists a real client never sends: bounded, since every stop check runs in the step all
    # requests share.
    Case("sampling-stop-65-strings", add(stop=["x"] * 65), InvalidRequestError,
         r"stop holds 65 strings; at most 64 are accepted"),
    Case("sampling-stop-200000-strings", add(stop=["x"] * 200_000), InvalidRequestError,
         r"stop holds 200000 strings; at most 64 are accepted"),
    Case("sampling-stop-string-513-chars", add(stop=["x" * 513]), InvalidRequestError,
         r"stop holds a string of 513 characters; each may have at most 512"),
    Case("sampling-stop-token-ids-129", add(stop_token_ids=list(range(129))), InvalidRequestError,
         r"stop_token_ids holds 129 ids; at most 128 are accepted"),
    Case("sampling-stop-token-ids-1000000", add(stop_token_ids=[7] * 1_000_000),
         InvalidRequestError, r"stop_token_ids holds 1000000 ids; at most 128 are accepted"),
    # Prompts.
    Case("prompt-empty-ids", add([]), InvalidRequestError, "prompt is empty"),
    Case("prompt-empty-text", add(""), InvalidRequestError, "prompt is empty"),
    Case("generate-prompt-empty-text", lambda ctx: ctx.engine.generate("", greedy(2)),
         InvalidRequestError, "prompt is empty"),
    Case("prompt-id-past-vocab", add([1, 10**6]), InvalidRequestError, r"token ids must be ints"),
    Case("prompt-id-negative", add([-1]), InvalidRequestError, r"token ids must be ints"),
    Case("prompt-id-bool", add([True, 2]), InvalidRequestError, r"token ids must be ints"),
    Case("prompt-id-float", add([1.0]), InvalidRequestError, r"token ids must be ints"),
    Case("prompt-too-long", add("x" * 5000), InvalidRequestError, "max_model_len"),
    Case(
        "request-id-in-flight",
        lambda ctx: ctx.engine.add_request("in-flight", "again"),
        InvalidRequestError,
        "already in flight",
    ),
    Case(
        "generate-params-length",
        lambda ctx: ctx.engine.generate(["a", "b"], [greedy(2)]),
        InvalidRequestError,
        "2 prompts but 1 sampling params",
    ),
    # Pause and the update transaction, called out of order or with bad values.
    Case(
        "pause-mode-unknown",
        lambda ctx: ctx.engine.pause_generation(mode="sideways"),
        InvalidRequestError,
        "mode",
    ),
    Case(
        "update-while-busy",
        lambda ctx: ctx.engine.update_weights({"update_info": info()}),
        EngineBusyError,
        "needs a paused or idle engine",
    ),
    Case(
        "start-update-while-busy",
        lambda ctx: ctx.engine.start_weight_update(),
        EngineBusyError,
        "needs a paused or idle engine",
    ),
    Case(
        "finish-without-start",
        lambda ctx: ctx.engine.finish_weight_update(),
        WeightUpdateStateError,
        "no weight update is in progress",
    ),
    Case(
        "finish-version-bool",
        lambda ctx: ctx.engine.finish_weight_update(True),
        WeightValidationError,
        "weight_version must be a string of at most 256 characters or a 64-bit int",
    ),
    Case(
        "finish-version-list",
        lambda ctx: ctx.engine.finish_weight_update(["v"]),
        WeightValidationError,
        "weight_version must be a string of at most 256 characters or a 64-bit int",
    ),
    Case(
        "update-envelope-missing",
        paused(lambda ctx: ctx.engine.update_weights(info())),
        InvalidRequestError,
        r"expects \{'update_info'",
    ),
    Case(
        "init-envelope-missing",
        lambda ctx: ctx.engine.init_weight_transfer_engine({"backend": "gloo"}),
        InvalidRequestError,
        r"expects \{'init_info'",
    ),
    # Update metadata that does not match the model: refused before any byte moves.
    Case("update-unknown-name", update(info(names=["model.nope"])), WeightValidationError, "nope"),
    Case("update-wrong-shape", update(info(shapes=[[65]])), WeightValidationError, r"update has float64\[65\]"),
    Case(
        "update-wrong-dtype",
        update(info(dtype_names=["float16"])),
        WeightValidationError,
        r"update has float16\[64\]",
    ),
    Case(
        "update-unknown-dtype",
        update(info(dtype_names=["complex512"])),
        WeightValidationError,
        "complex512",
    ),
    Case(
        "update-lengths-differ",
        update(info(shapes=[[64], [64]])),
        WeightValidationError,
        "equal lengths",
    ),
    Case(
        "update-duplicate-names",
        update(info(names=["model.norm.weight"] * 2, dtype_names=["float64"] * 2, shapes=[[64]] * 2)),
        WeightValidationError,
        "model.norm.weight",
    ),
    Case(
        "update-version-bool",
        update(info(weight_version=True)),
        WeightValidationError,
        "weight_version",
    ),
    # Engine configuration.
    Case("config-max-num-seqs", lambda ctx: EngineConfig(max_num_seqs=0), EngineConfigError, "max_num_seqs"),
    Case("config-seed-bool", lambda ctx: EngineConfig(seed=True), EngineConfigError, "seed"),
    Case("config-device", lambda ctx: EngineConfig(device="tpu:0"), EngineConfigError, "device"),
    Case(
        "config-refuse-non-finite",
        lambda ctx: EngineConfig(refuse_non_finite_weights="yes"),
        EngineConfigError,
        "refuse_non_finite_weights",
    ),
    Case("config-max-model-len", lambda ctx: EngineConfig(max_model_len=1), EngineConfigError, "max_model_len"),
    Case("config-transfer-backend-list", lambda ctx: WeightTransferConfig(backend=["gloo"]),
         WeightValidationError, r"backend must be a string .* got list \['gloo'\]"),
]  # fmt: skip


class Context:
    """The shared engine (with a request in flight during each case) and a counter of ids."""

    def __init__(self) -> None:
        self.source = LocalSource("bad-input")
        SOURCES[self.source.key] = self.source
        self.engine = make_engine(max_model_len=256)
        self.engine.init_weight_transfer_engine(self.source.init_request)
        self._count = 0
        self.expected = self.engine.generate(["in-flight"], greedy(IN_FLIGHT_TOKENS))[0]
        self.weights = {n: t.clone() for n, t in self.engine.model.named_weights()}

    def count(self) -> int:
        self._count += 1
        return self._count


@pytest.fixture(scope="module")
def ctx():
    context = Context()
    yield context
    del SOURCES[context.source.key]
    context.engine.shutdown()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_python_input_is_refused_and_changes_nothing(ctx, case, record_property):
    """A bad value through the Python API: refused with its weightsync error, nothing moved."""
    engine = ctx.engine
    engine.abort_request(f"bad-{ctx._count}")  # a case that wrongly succeeded leaves its request
    while engine.has_unfinished_requests():  # nor does it hold up the next case
        engine.step()
    version = engine.weight_version
    engine.add_request("in-flight", "in-flight", greedy(IN_FLIGHT_TOKENS))
    engine.step()
    engine.step()  # the request holds KV and two tokens when the case runs
    with pytest.raises(case.error, match=case.message) as caught:
        case.call(ctx)
    record_property("error", type(caught.value).__name__)
    record_property("message", str(caught.value)[:160])
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "in-flight" and out.finished:
                final = out
    assert final is not None
    assert final.outputs[0].token_ids == ctx.expected.outputs[0].token_ids
    assert engine.weight_version == version
    assert engine.weight_update is None and not engine.weights.is_torn
    for name, tensor in engine.model.named_weights():
        assert torch.equal(tensor, ctx.weights[name]), name
