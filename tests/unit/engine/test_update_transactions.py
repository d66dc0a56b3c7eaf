"""Update transactions: start / update / finish / abort, and never a torn engine that computes.

The IPC cases record an update's messages (announcement, then parts) without delivering them, so
each test can deliver them in whatever order, late, twice or never, as a faulty trainer would.
"""

import asyncio

import pytest
import torch
from engine_helpers import debug_model, greedy, make_engine

from weightsync.config import WeightTransferConfig
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.llm_engine import LLMEngine
from weightsync.errors import (
    EngineBusyError,
    EngineStateError,
    IncompleteWeightUpdateError,
    TornWeightsError,
    WeightTransferError,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.trainer.senders import IPCWeightSender
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

BUCKET = 128 << 10  # the debug model (~0.5 MB) then travels in ~5 parts


def weights_of(engine):
    return {name: t.clone() for name, t in engine.model.named_weights()}


def assert_weights(engine, expected):
    for name, tensor in engine.model.named_weights():
        assert torch.equal(tensor, expected[name]), name


@pytest.fixture
def session():
    # Enough buffers that no part's buffer is refilled: recorded parts stay deliverable.
    session = ipc_trainer_init(packed=True, bucket_size_bytes=BUCKET, num_buffers=16)
    yield session
    session.close()


def record(session, named_tensors, weight_version=None):
    """Runs a send whose deliveries are only recorded: [announcement, part, part, ...]."""
    messages = []
    args = IPCTrainerSendWeightsArgs(
        session, lambda info: messages.append({"update_info": info}), weight_version=weight_version
    )
    ipc_trainer_send_weights(named_tensors, args)
    return messages


def ipc_engine(session, **config):
    engine = LLMEngine(debug_model(seed=0), **config)
    engine.init_weight_transfer_engine({"init_info": session.init_info})
    return engine


@pytest.fixture(scope="module")
def policy():
    return dict(debug_model(seed=1).named_weights())


@pytest.fixture(scope="module")
def policy2():
    return dict(debug_model(seed=2).named_weights())


# --- the four calls -----------------------------------------------------------------------------


def test_the_version_moves_only_at_finish_and_nothing_computes_in_between(local_source, policy):
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors = policy
    engine.start_weight_update()
    engine.add_request("r", "hello", greedy(3))
    engine.update_weights(local_source.update_info(weight_version="ignored"))
    assert engine.weight_version == 0
    assert engine.step() == [] and engine.num_steps == 0  # queued until the update ends
    engine.finish_weight_update("v1")
    assert engine.weight_version == "v1" and not engine.is_paused()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_steps == 3
    assert_weights(engine, policy)


def test_calls_out_of_order_are_refused_and_say_what_comes_next(local_source):
    engine = make_engine()
    engine.start_weight_update()
    with pytest.raises(EngineStateError, match=r"init_weight_transfer_engine"):
        engine.update_weights(local_source.update_info())  # a message needs a transfer
    assert engine.finish_weight_update("never") is False  # its message was refused: unapplied
    assert engine.weight_version == 0
    engine.start_weight_update()  # as vLLM: an update with no message is a relabel
    assert engine.finish_weight_update("relabelled") is True
    assert engine.weight_version == "relabelled"
    engine.init_weight_transfer_engine(local_source.init_request)
    with pytest.raises(WeightUpdateStateError, match=r"start_weight_update\(\) and update_weights"):
        engine.finish_weight_update()
    engine.start_weight_update()
    with pytest.raises(WeightUpdateStateError, match=r"already in progress: finish it"):
        engine.start_weight_update()
    with pytest.raises(WeightUpdateStateError, match=r"abort_weight_update\(\) first"):
        engine.resume_generation()
    assert engine.abort_weight_update() is True
    assert engine.abort_weight_update() is False  # harmless without a transaction


def test_start_on_a_busy_unpaused_engine_says_to_pause_first(local_source):
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    engine.add_request("r", "hello", greedy(8))
    engine.step()
    with pytest.raises(EngineBusyError, match=r"call pause_generation"):
        engine.start_weight_update()
    assert engine.weight_update is None
    engine.pause_generation(mode="keep")
    engine.start_weight_update()
    engine.finish_weight_update()
    assert engine.is_paused()  # the caller's pause outlives the transaction


def test_finishing_an_incomplete_update_names_what_is_missing_and_stays_open(session, policy):
    engine = ipc_engine(session)
    announcement, first, *rest = record(session, policy.items(), weight_version=7)
    assert len(rest) >= 2
    engine.start_weight_update()
    engine.update_weights(announcement)
    engine.update_weights(first)
    missing = sorted(set(policy) - set(first["update_info"]["names"]))
    with pytest.raises(IncompleteWeightUpdateError, match=rf"{len(missing)} announced weights"):
        engine.finish_weight_update()
    for part in rest:
        engine.update_weights(part)
    engine.finish_weight_update()
    assert engine.weight_version == 7 and not engine.weights.is_torn
    assert_weights(engine, policy)


# --- refusals leave everything as it was --------------------------------------------------------


def test_a_rejection_by_another_engine_leaves_every_engine_resumable(session, policy):
    accepting = LLMEngine(debug_model(seed=0))
    rejecting = LLMEngine(debug_model(seed=0).float())
    before = weights_of(accepting)
    for engine in (accepting, rejecting):
        engine.pause_generation(mode="keep")
    with IPCWeightSender([accepting, rejecting]) as sender, pytest.raises(WeightValidationError):
        sender.send(policy.items(), weight_version=1)
    for engine in (accepting, rejecting):
        assert engine.weight_update is None and not engine.weights.is_torn
        assert engine.weight_version == 0
        engine.resume_generation()
    assert_weights(accepting, before)


@pytest.mark.parametrize("explicit", [False, True])
def test_a_message_of_another_update_is_refused_without_touching_the_current_one(
    session, policy, policy2, explicit
):
    engine = ipc_engine(session)
    old = record(session, policy.items(), weight_version="old")
    new = record(session, policy2.items(), weight_version="new")
    if explicit:
        engine.start_weight_update()
    engine.update_weights(new[0])
    engine.update_weights(new[1])
    late = old[2]
    with pytest.raises(WeightValidationError, match=r"refused"):
        engine.update_weights(late)  # a late part of an earlier update
    with pytest.raises(WeightValidationError, match=r"expects tensor"):
        engine.update_weights(new[1])  # duplicated
    with pytest.raises(WeightValidationError, match=r"expects tensor"):
        engine.update_weights(new[3])  # out of order
    if explicit:  # inside a transaction, even a whole other update is refused
        with pytest.raises(WeightValidationError, match=r"transaction in progress is for update"):
            engine.update_weights(old[0])
    for part in new[2:]:
        engine.update_weights(part)
    if explicit:
        engine.finish_weight_update()
    assert engine.weight_version == "new" and not engine.weights.holds_generation
    assert_weights(engine, policy2)


def test_a_refused_announcement_leaves_the_bare_update_in_progress_going_on(
    session, policy, policy2
):
    engine = ipc_engine(session)
    late = record(session, policy2.items(), weight_version="late")
    current = record(session, policy.items(), weight_version="current")  # recorded last: intact
    engine.update_weights(current[0])
    engine.update_weights(current[1])
    bad = {"update_info": {**late[0]["update_info"], "shapes": [[3]] * len(policy2)}}
    with pytest.raises(WeightValidationError, match=r"model has"):
        engine.update_weights(bad)  # an announcement the model refuses
    for part in current[2:]:
        engine.update_weights(part)
    assert engine.weight_version == "current" and not engine.weights.holds_generation
    assert_weights(engine, policy)


def test_a_late_announcement_of_an_earlier_update_is_refused(session, policy, policy2):
    engine = ipc_engine(session)
    earlier = record(session, policy2.items(), weight_version="earlier")
    for message in earlier:
        engine.update_weights(message)
    current = record(session, policy.items(), weight_version="current")
    engine.update_weights(current[0])
    engine.update_weights(current[1])
    with pytest.raises(WeightValidationError, match=r"already announced"):
        engine.update_weights(earlier[0])  # late: it must not replace the update in progress
    for part in current[2:]:
        engine.update_weights(part)
    assert engine.weight_version == "current" and not engine.weights.holds_generation
    assert_weights(engine, policy)


# --- torn weights never compute -----------------------------------------------------------------


def test_an_abandoned_part_then_a_partial_update_keeps_the_engine_torn(session, policy):
    engine = ipc_engine(session)
    engine.add_request("r", "hello", greedy(4))
    abandoned = record(session, policy.items(), weight_version="a")
    engine.update_weights(abandoned[0])
    engine.update_weights(abandoned[1])  # and the rest never comes
    one = [("model.norm.weight", policy["model.norm.weight"])]
    announcement, part = record(session, one, weight_version="b")
    engine.update_weights(announcement)
    with pytest.raises(WeightValidationError):  # a rejected update in between changes nothing
        engine.update_weights({"update_info": {**announcement["update_info"], "shapes": [[3]]}})
    with pytest.raises(TornWeightsError, match=r"still torn \(a failed weight update left"):
        engine.update_weights(part)
    assert engine.weight_version == 0 and engine.weights.is_torn
    engine.scheduler.resume()  # whatever path unpauses the scheduler, the step stays guarded
    assert engine.step() == [] and engine.num_steps == 0
    with pytest.raises(TornWeightsError):
        engine.resume_generation()
    for message in record(session, policy.items(), weight_version="c"):
        engine.update_weights(message)
    assert engine.weight_version == "c" and not engine.weights.is_torn
    engine.resume_generation()
    engine.step()
    assert engine.num_steps == 1


def test_a_bare_update_on_an_idle_engine_holds_requests_until_its_last_part(session, policy):
    engine = ipc_engine(session)
    messages = record(session, policy.items(), weight_version=1)
    for index, message in enumerate(messages[:-1]):
        engine.update_weights(message)
        engine.add_request(f"r{index}", "hello", greedy(2))
        assert engine.step() == [] and engine.num_steps == 0
    engine.update_weights(messages[-1])
    assert not engine.is_paused() and engine.weight_version == 1
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.outputs[0].weight_versions == [1, 1]


def test_a_request_queued_during_a_bare_async_update_runs_once_its_last_part_lands(session, policy):
    async def main():
        async with AsyncEngine.from_engine(ipc_engine(session)) as engine:
            messages = record(session, policy.items(), weight_version=1)
            await engine.update_weights(messages[0])
            first = asyncio.ensure_future(anext(engine.generate("hello", greedy(2))))
            await engine.wait_until_idle()  # the loop saw the request, and computes nothing
            assert engine.num_steps == 0
            for part in messages[1:]:
                await engine.update_weights(part)
            output = await asyncio.wait_for(first, timeout=30)
            versions = output.outputs[0].weight_versions  # one token or both, as read
            assert versions in ([1], [1, 1])

    asyncio.run(main())


# --- abort and staging --------------------------------------------------------------------------


def test_abort_before_any_byte_moved_restores_the_previous_state(session, policy):
    engine = ipc_engine(session)
    messages = record(session, policy.items())
    engine.start_weight_update()
    engine.update_weights(messages[0])  # the announcement moves nothing
    assert engine.is_paused()
    assert engine.abort_weight_update()
    assert not engine.is_paused() and not engine.weights.is_torn and engine.weight_version == 0


@pytest.mark.parametrize("staging", [False, True])
def test_abort_after_bytes_moved_tears_or_restores(session, policy, staging):
    engine = ipc_engine(session)
    engine.config.weight_update_staging = staging  # read at construction: set it on the weights
    engine.weights.staging = staging
    before = weights_of(engine)
    messages = record(session, policy.items(), weight_version=1)
    engine.start_weight_update()
    engine.update_weights(messages[0])
    engine.update_weights(messages[1])
    engine.abort_weight_update()
    assert engine.weight_version == 0 and engine.weight_update is None
    if staging:
        assert_weights(engine, before)
        assert not engine.is_paused()  # back to running, on the previous weights
    else:
        assert engine.weights.torn_names == set(messages[1]["update_info"]["names"])
        assert engine.is_paused()
        with pytest.raises(TornWeightsError):
            engine.resume_generation()


def test_staging_restores_the_weights_after_a_failed_transfer(local_source, policy):
    engine = make_engine(weight_update_staging=True)
    engine.init_weight_transfer_engine(local_source.init_request)
    before = weights_of(engine)
    local_source.tensors, local_source.fail_after = policy, 5
    with pytest.raises(WeightTransferError) as failure:
        engine.update_weights(local_source.update_info(weight_version=1))
    assert failure.value.partially_applied
    assert_weights(engine, before)
    assert engine.weight_version == 0 and not engine.weights.holds_generation
    assert not engine.is_paused()


@pytest.mark.parametrize("explicit", [False, True])
def test_a_duplicated_announcement_is_refused_without_restarting_the_update(
    session, policy, explicit
):
    engine = ipc_engine(session)
    messages = record(session, policy.items(), weight_version="new")
    if explicit:
        engine.start_weight_update()
    engine.update_weights(messages[0])
    engine.update_weights(messages[1])
    with pytest.raises(WeightValidationError, match=r"already announced"):
        engine.update_weights(messages[0])  # delivered twice
    for part in messages[2:]:
        engine.update_weights(part)
    if explicit:
        engine.finish_weight_update()
    assert engine.weight_version == "new" and not engine.weights.holds_generation
    assert_weights(engine, policy)
    with pytest.raises(WeightValidationError, match=r"already announced"):
        engine.update_weights(messages[0])  # late: it must not hold the engine for parts
    assert not engine.weights.holds_generation and not engine.is_paused()


def test_init_during_an_update_is_refused_and_keeps_it(session, policy):
    engine = ipc_engine(session)
    announcement, *parts = record(session, policy.items(), weight_version=2)
    engine.update_weights(announcement)
    with pytest.raises(WeightUpdateStateError, match=r"update is in progress"):
        engine.init_weight_transfer_engine({"init_info": session.init_info})
    for part in parts:
        engine.update_weights(part)
    assert engine.weight_version == 2 and not engine.weights.holds_generation


def test_a_failed_staging_copy_refuses_the_update_and_leaves_no_transaction(
    local_source, policy, monkeypatch
):
    engine = make_engine(weight_update_staging=True)
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors = policy

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for the staged copy")

    monkeypatch.setattr(engine.weights, "_stage", out_of_memory)
    with pytest.raises(WeightTransferError, match=r"staging a copy .* nothing moved") as failure:
        engine.update_weights(local_source.update_info(weight_version=1))
    assert not failure.value.partially_applied
    assert engine.weight_update is None and not engine.weights.holds_generation
    assert engine.weight_version == 0 and not engine.is_paused()


@pytest.mark.parametrize("version", [True, 1.5, ["v"], "x" * 257, 10**4000 // 10**3950])
def test_a_weight_version_that_is_not_a_short_string_or_an_int_is_refused(local_source, version):
    # Every generated token carries the label: a 4000-digit int or a long text would bloat
    # every answer.
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    engine.start_weight_update()
    with pytest.raises(
        WeightValidationError, match="weight_version must be a string of at most 256 characters"
    ):
        engine.finish_weight_update(version)
    assert engine.weight_update is not None  # still open: finish it properly
    engine.finish_weight_update("v1")
    assert engine.weight_version == "v1"


def test_shutting_the_transfer_engine_down_unmaps_and_a_later_init_starts_afresh(session, policy):
    engine = ipc_engine(session)
    for message in record(session, policy.items(), weight_version="v1"):
        engine.update_weights(message)
    mappings = engine.weights._transfer._mappings
    assert engine.weight_version == "v1" and mappings.open_segments != []
    engine.start_weight_update()
    with pytest.raises(WeightUpdateStateError, match="shutdown_weight_transfer_engine: a weight"):
        engine.shutdown_weight_transfer_engine()  # the update in progress stays
    engine.abort_weight_update()
    engine.shutdown_weight_transfer_engine()
    assert mappings.open_segments == [] and engine.weight_version == "v1"
    assert engine.weights._transfer is None  # forgotten: the next init may name any backend
    with pytest.raises(EngineStateError, match=r"call init_weight_transfer_engine"):
        engine.update_weights(record(session, policy.items())[0])  # no transfer until an init
    again = ipc_trainer_init(packed=True, bucket_size_bytes=BUCKET, num_buffers=16)
    try:
        engine.init_weight_transfer_engine({"init_info": again.init_info})
        for message in record(again, policy.items(), weight_version="v2"):
            engine.update_weights(message)
        assert engine.weight_version == "v2"
    finally:
        engine.shutdown()
        again.close()


def test_the_async_engine_shuts_its_transfer_engine_down_off_the_event_loop(session, policy):
    async def main():
        async with AsyncEngine(ipc_engine(session)) as engine:
            for message in record(session, policy.items()):
                await engine.update_weights(message)
            transfer = engine.engine.weights._transfer
            await engine.shutdown_weight_transfer_engine()
            assert not transfer.is_initialized and engine.engine.weights._transfer is None

    asyncio.run(main())


def test_a_per_rank_list_of_update_infos_gives_each_engine_its_own_entry(local_source, policy):
    # vLLM's data-parallel trainer sends one update info per worker rank: it was refused.
    engine = LLMEngine(
        debug_model(),
        engine_config=make_engine().config,
        weight_transfer_config=WeightTransferConfig(backend="test-local"),
        worker_index=1,
    )
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors = policy
    other = local_source.update_info(weight_version="not-mine")["update_info"]
    mine = local_source.update_info(weight_version="mine")["update_info"]
    engine.update_weights({"update_info": [other, mine]})
    assert engine.weight_version == "mine"
    with pytest.raises(
        WeightValidationError, match=r"list of 1 entries, .* this engine is worker 1"
    ):
        engine.update_weights({"update_info": [other]})
    assert engine.weight_version == "mine"
