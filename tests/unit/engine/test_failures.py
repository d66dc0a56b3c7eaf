"""A failing request fails alone; an update with non-finite weights can be refused.

Failures are injected deterministically: the sampler turns the logits of one marked request into
NaN (the real sampler then refuses that row's probabilities, as it would for NaN logits from the
model), or processing raises for one request.
"""

import asyncio
import math

import pytest
import torch
from engine_helpers import Stream, greedy, make_async_engine, make_engine

import weightsync.engine._model_runner as model_runner
from weightsync.engine._processing import OutputProcessor
from weightsync.engine._sampler import sample
from weightsync.engine.sampling import SamplingParams
from weightsync.errors import NonFiniteWeightsError, TornWeightsError

POISON_SEED = 4242  # the request that carries this seed gets NaN logits


@pytest.fixture
def poisoned_sampler(monkeypatch):
    """Makes sampling fail for the requests seeded with POISON_SEED, in any batch they run in."""

    def poisoned(logits, rows, eos_token_ids):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.sampling_params.seed == POISON_SEED:
                logits[i] = math.nan
        return sample(logits, rows, eos_token_ids)

    monkeypatch.setattr(model_runner, "sample", poisoned)


def test_nan_probabilities_end_one_request_and_the_batch_goes_on(poisoned_sampler):
    engine = make_engine()
    good = greedy(6)
    bad = SamplingParams(temperature=1.0, max_tokens=6, seed=POISON_SEED, ignore_eos=True)
    alone = make_engine().generate(["first", "third"], good)
    outputs = engine.generate(["first", "second", "third"], [good, bad, good])
    first, second, third = (o.outputs[0] for o in outputs)
    assert second.finish_reason == "error"
    assert second.token_ids == []
    assert (first.finish_reason, third.finish_reason) == ("length", "length")
    # The survivors' tokens are exactly those of a batch without the failing request.
    assert [first.token_ids, third.token_ids] == [o.outputs[0].token_ids for o in alone]
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    # The engine still serves afterwards.
    assert engine.generate(["again"], good)[0].outputs[0].finish_reason == "length"


def test_a_request_that_fails_mid_output_keeps_its_tokens(poisoned_sampler, monkeypatch):
    engine = make_engine()
    original = OutputProcessor._check_stop

    def check_stop(self, seq, token):
        if seq.request_id == "fragile" and seq.num_output_tokens == 3:
            raise RuntimeError("stop check failed (injected)")
        original(self, seq, token)

    monkeypatch.setattr(OutputProcessor, "_check_stop", check_stop)
    engine.add_request("fragile", "one", greedy(8))
    engine.add_request("sturdy", "two", greedy(8))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["fragile"].finish_reason == "error"
    assert len(finals["fragile"].token_ids) == 3
    assert finals["sturdy"].finish_reason == "length"
    assert len(finals["sturdy"].token_ids) == 8


def test_a_failure_of_every_request_ends_them_all_and_the_engine_lives(monkeypatch):
    engine = make_engine()

    def broken(logits, rows, eos_token_ids):
        raise RuntimeError("device lost (injected)")

    monkeypatch.setattr(model_runner, "sample", broken)
    outputs = engine.generate(["a", "b"], greedy(4))
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "error"]
    monkeypatch.undo()
    assert len(engine.generate(["c"], greedy(4))[0].outputs[0].token_ids) == 4


# --- non-finite weights -------------------------------------------------------------------------


def _poisoned(new_weights, name="model.layers.0.mlp.down_proj.weight"):
    tensors = {n: t.clone() for n, t in new_weights.items()}
    tensors[name][0, 0] = math.inf
    return tensors, name


@pytest.mark.parametrize("staging", [True, False])
def test_non_finite_update_is_refused_at_finish(local_source, new_weights, staging):
    engine = make_engine(refuse_non_finite_weights=True, weight_update_staging=staging)
    before = {n: t.clone() for n, t in engine.model.named_weights()}
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors, bad_name = _poisoned(new_weights)
    engine.start_weight_update()
    engine.update_weights(local_source.update_info())
    with pytest.raises(NonFiniteWeightsError, match=bad_name.replace(".", r"\.")):
        engine.finish_weight_update("v-nan")
    assert engine.weight_version == 0
    assert engine.weight_update is None
    if staging:  # the previous weights, bit for bit, and the engine serves them
        for name, tensor in engine.model.named_weights():
            assert torch.equal(tensor, before[name]), name
        assert len(engine.generate(["ok"], greedy(3))[0].outputs[0].token_ids) == 3
    else:  # torn: never generated from
        with pytest.raises(TornWeightsError):
            engine.generate(["no"], greedy(3))
    # A finite update lands afterwards.
    local_source.tensors = new_weights
    engine.update_weights(local_source.update_info(weight_version="v-ok"))
    assert engine.weight_version == "v-ok"
    assert all(torch.isfinite(t).all() for _, t in engine.model.named_weights())


def test_non_finite_bare_update_is_refused_and_finite_ones_pass(local_source, new_weights):
    engine = make_engine(refuse_non_finite_weights=True, weight_update_staging=True)
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors, _ = _poisoned(new_weights)
    with pytest.raises(NonFiniteWeightsError, match="version stays 0"):
        engine.update_weights(local_source.update_info(weight_version=7))
    assert engine.weight_version == 0


def test_non_finite_weights_are_accepted_by_default(local_source, new_weights):
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors, _ = _poisoned(new_weights)
    engine.update_weights(local_source.update_info())
    assert engine.weight_version == 1


def test_engine_seeds_of_any_size_give_valid_generators():
    # A derived seed wraps into what torch.Generator takes, whatever the engine's seed.
    for seed in (2**63 - 1, -(2**63), 2**70):
        engine = make_engine(seed=seed)
        out = engine.generate(["x"], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2


def test_streams_end_with_error_alone_and_the_async_engine_goes_on(poisoned_sampler):
    async def main():
        async with make_async_engine() as engine:
            bad = SamplingParams(temperature=1.0, max_tokens=5, seed=POISON_SEED)
            good_stream = Stream(engine, "good", greedy(12))
            bad_stream = Stream(engine, "bad", bad)
            assert (await bad_stream.final()).outputs[0].finish_reason == "error"
            assert (await good_stream.final()).outputs[0].finish_reason == "length"
            good_stream.check_consistent()
            again = Stream(engine, "again", greedy(3))
            assert len((await again.final()).outputs[0].token_ids) == 3

    asyncio.run(main())
