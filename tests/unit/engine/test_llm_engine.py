import pytest
import torch
from engine_helpers import DTYPE, PROMPTS, greedy, reference_greedy, small_config

from weightsync.engine.config import EngineConfig
from weightsync.engine.errors import EngineConfigError, EngineStateError, InvalidRequestError
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(("preset", "dtype"), [("debug", DTYPE), ("tiny", torch.float32)])
def test_greedy_equals_a_reference_decode_without_kv_cache(preset, dtype):
    model = LlamaForCausalLM.from_preset(preset, seed=0, dtype=dtype)
    engine = LLMEngine(model, engine_config=small_config())
    prompts = PROMPTS[:6] if preset == "debug" else PROMPTS[:3]
    outputs = engine.generate(prompts, greedy(20))
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference_greedy(model, engine.tokenizer.encode(prompt), 20)
        assert output.outputs[0].token_ids == expected, prompt
        assert output.outputs[0].finish_reason == "length"
        assert output.outputs[0].text == engine.tokenizer.decode(expected)


def test_batched_equals_one_at_a_time(debug_model):
    batched = LLMEngine(debug_model, engine_config=small_config()).generate(PROMPTS, greedy(16))
    single = LLMEngine(debug_model, engine_config=small_config(enable_prefix_caching=False))
    alone = [single.generate([p], greedy(16))[0] for p in PROMPTS]
    assert token_ids(batched) == token_ids(alone)


def test_prefix_cache_hits_change_nothing(debug_model):
    shared = "A long shared system prompt that fills several KV blocks. "
    prompts = [shared + tail for tail in ("first", "second", "third", "fourth")]
    cached = LLMEngine(debug_model, engine_config=small_config())
    cached.generate([prompts[0]], greedy(4))  # warms the prefix cache
    hits = cached.generate(prompts, greedy(12))
    assert all(o.num_cached_tokens >= 48 for o in hits)
    uncached = LLMEngine(debug_model, engine_config=small_config(enable_prefix_caching=False))
    misses = uncached.generate(prompts, greedy(12))
    assert all(o.num_cached_tokens == 0 for o in misses)
    assert token_ids(hits) == token_ids(misses)


def test_chunked_prefill_and_preemption_change_nothing(debug_model):
    expected = token_ids(
        LLMEngine(debug_model, engine_config=small_config()).generate(PROMPTS, greedy(16))
    )
    chunked = LLMEngine(
        debug_model, engine_config=small_config(max_num_batched_tokens=16, max_num_seqs=4)
    )
    assert token_ids(chunked.generate(PROMPTS, greedy(16))) == expected
    tight = LLMEngine(debug_model, engine_config=small_config(num_kv_blocks=16, max_model_len=128))
    assert token_ids(tight.generate(PROMPTS, greedy(16))) == expected
    assert tight.scheduler.num_preemptions > 0


def test_seeded_sampling_does_not_depend_on_the_batch(debug_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    engine = LLMEngine(debug_model, engine_config=small_config())
    alone = engine.generate(["sampled"], params)[0]
    crowd = engine.generate(["sampled", *PROMPTS[:5]], [params] + [greedy(12)] * 5)[0]
    assert alone.outputs[0].token_ids == crowd.outputs[0].token_ids
    unseeded = engine.generate(
        ["sampled"] * 4, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    )
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_stop_conditions(debug_model):
    engine = LLMEngine(debug_model, engine_config=small_config(max_model_len=64))
    free = engine.generate(["Hello"], greedy(12))[0].outputs[0]
    stop = free.text[3:5]
    stopped = engine.generate(["Hello"], greedy(12, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[: free.text.index(stop)]
    by_token = engine.generate(["Hello"], greedy(12, stop_token_ids=[free.token_ids[2]]))[
        0
    ].outputs[0]
    assert by_token.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[2]) + 1]
    assert by_token.stop_reason == free.token_ids[2]
    long_prompt = "y" * 60  # 61 tokens with BOS: 3 left before max_model_len
    assert len(engine.generate([long_prompt], greedy(12))[0].outputs[0].token_ids) == 3


def test_eos_ends_the_output(debug_model):
    engine = LLMEngine(debug_model, engine_config=small_config())
    eos = engine.tokenizer.eos_token_id
    out = engine.generate(
        ["Hello"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[])
    )[0].outputs[0]
    assert (eos in out.token_ids) == (out.finish_reason == "stop")


def test_token_id_prompts_and_request_errors(debug_model):
    engine = LLMEngine(debug_model, engine_config=small_config(max_model_len=32))
    ids = engine.tokenizer.encode("hi")
    by_ids = engine.generate([ids], greedy(4))[0]
    assert (
        by_ids.prompt is None
        and by_ids.outputs[0].token_ids == engine.generate("hi", greedy(4))[0].outputs[0].token_ids
    )
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request("e", [], greedy(4))
    for bad in ([999], [True, 1]):  # a bool is not a token id
        with pytest.raises(InvalidRequestError, match=r"token ids must be ints in \[0, 259\)"):
            engine.add_request("e", bad, greedy(4))
    with pytest.raises(InvalidRequestError, match="max_model_len is 32"):
        engine.add_request("e", "z" * 40, greedy(4))
    engine.add_request("dup", "a", greedy(4))
    with pytest.raises(InvalidRequestError, match="'dup' is already in flight"):
        engine.add_request("dup", "b", greedy(4))
    with pytest.raises(EngineConfigError, match="KV cache holds 64 tokens"):
        LLMEngine(debug_model, engine_config=EngineConfig(num_kv_blocks=4, max_model_len=128))


def test_abort_request_returns_the_partial_output(debug_model):
    engine = LLMEngine(debug_model, engine_config=small_config())
    engine.add_request("a", "abort me", greedy(50))
    engine.add_request("b", "keep me", greedy(5))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["a"].finished and outputs["a"].outputs[0].finish_reason == "abort"
    assert len(outputs["a"].outputs[0].token_ids) == 3
    while engine.has_unfinished_requests():
        engine.step()


def test_steps_mixing_decodes_and_prefills_equal_the_reference(debug_model):
    # Requests arriving while others decode make steps whose decodes and prefill chunks are
    # attended in two padded groups; prompts of different lengths pad both.
    engine = LLMEngine(
        debug_model, engine_config=small_config(max_num_batched_tokens=24, max_num_seqs=8)
    )
    params = greedy(12)
    engine.add_request("first", PROMPTS[0], params)
    for _ in range(3):
        engine.step()
    for index, prompt in enumerate(PROMPTS[1:4]):
        engine.add_request(f"late-{index}", prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for request_id, prompt in zip(["first", "late-0", "late-1", "late-2"], PROMPTS, strict=False):
        expected = reference_greedy(debug_model, engine.tokenizer.encode(prompt), 12)
        assert finals[request_id].outputs[0].token_ids == expected, request_id


def test_device_option_is_checked_and_places_the_engine(debug_model):
    with pytest.raises(EngineConfigError, match=r"EngineConfig\.device must name a torch device"):
        EngineConfig(device="gpu0")
    with pytest.raises(EngineConfigError, match=r"EngineConfig\.device must name a torch device"):
        EngineConfig(device=0)  # type: ignore[arg-type]
    assert EngineConfig(device=torch.device("cpu")).device == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(EngineConfigError, match="torch sees no CUDA device here"):
            LLMEngine(debug_model, engine_config=small_config(device="cuda"))
    engine = LLMEngine(debug_model, engine_config=small_config(device="cpu"))
    assert engine.device == torch.device("cpu")
    assert all(cache.device.type == "cpu" for cache in engine.runner.kv_caches)
    assert engine.generate(PROMPTS[:1], greedy(3))[0].outputs[0].token_ids


def test_a_config_of_the_wrong_type_and_a_prompt_of_the_wrong_type_are_named():
    with pytest.raises(
        EngineConfigError, match="engine_config must be None or an instance of EngineConfig"
    ):
        LLMEngine("debug", engine_config={"num_kv_blocks": 64})
    with pytest.raises(
        EngineConfigError, match="weight_transfer_config must be None or an instance of"
    ):
        LLMEngine("debug", weight_transfer_config={"backend": "gloo"})
    engine = LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match="a string or a list of token ids, got NoneType"):
        engine.generate([None], SamplingParams(max_tokens=2))


@pytest.mark.reliability("bad-input")
def test_a_shut_down_engine_runs_nothing_more(debug_model, record_property):
    """`LLMEngine.generate` after `shutdown()`: refused, as by a shut-down `AsyncEngine`."""
    engine = LLMEngine(debug_model, engine_config=small_config())
    engine.add_request("in-flight", "in flight", greedy(8))
    engine.step()
    engine.shutdown()
    engine.shutdown()  # harmless twice
    calls = {
        "generate": lambda: engine.generate("hi", greedy(2)),
        "add_request": lambda: engine.add_request("late", "hi", greedy(2)),
        "step": engine.step,
        "init_weight_transfer_engine": lambda: engine.init_weight_transfer_engine(
            {"init_info": {"backend": "ipc", "session": "weightsync-0123456789ab"}}
        ),
        "start_weight_update": engine.start_weight_update,
        "update_weights": lambda: engine.update_weights({"update_info": {}}),
    }
    for call, run in calls.items():
        with pytest.raises(EngineStateError, match=rf"{call}: this LLMEngine was shut down"):
            run()
    record_property("error", "EngineStateError")
