"""Weight senders into in-process engines: broadcast over gloo, IPC through shared memory."""

import contextlib
import socket
import threading

import pytest
import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.errors import (
    WeightTransferError,
    WeightTransferTimeout,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.trainer.http_client import HTTPEngineClient
from weightsync.trainer.senders import (
    BroadcastWeightSender,
    IPCWeightSender,
    create_weight_sender,
)


def engine(worker_index=0):
    return LLMEngine(
        "debug", seed=0, engine_config=EngineConfig(num_kv_blocks=64), worker_index=worker_index
    )


@pytest.fixture(scope="module")
def policy():
    return LlamaForCausalLM.from_preset("debug", seed=1)


def assert_holds(engine, policy):
    held = dict(engine.model.named_weights())
    for name, tensor in policy.named_weights():
        assert torch.equal(held[name], tensor), name


def test_create_weight_sender_picks_the_class_by_backend():
    engines = [engine()]
    with create_weight_sender("ipc", engines) as sender:
        assert isinstance(sender, IPCWeightSender)
    sender = create_weight_sender("gloo", engines, timeout_s=5)
    assert isinstance(sender, BroadcastWeightSender)
    assert sender.backend == "gloo"
    sender.close()


def test_an_unknown_backend_is_named_with_the_known_ones():
    with pytest.raises(WeightValidationError, match=r"'nccl', 'gloo' or 'ipc', got 'mpi'"):
        create_weight_sender("mpi", [engine()])


def test_a_sender_needs_engines():
    with pytest.raises(WeightValidationError, match="at least one engine"):
        IPCWeightSender([])


def test_a_sender_refuses_an_engine_whose_calls_are_coroutines(policy):
    # A sender calls its engines from threads and cannot await: an AsyncEngine's update would
    # never run, while send() returned as if it had.
    async_engine = AsyncEngine.from_engine(engine())
    with pytest.raises(
        WeightValidationError, match=r"engines\[0\] \(AsyncEngine\) answers with coroutines"
    ):
        IPCWeightSender([async_engine])


def test_broadcast_ranks_follow_the_engines_order():
    sender = BroadcastWeightSender([engine(worker_index=1), engine(worker_index=0)], backend="gloo")
    with pytest.raises(WeightValidationError, match=r"engines\[0\] has worker_index 1"):
        sender.connect()  # checked before any group forms
    sender.close()


class TwoWorkers:
    """An engine that holds two transfer workers, as a data-parallel server does."""

    worker_index = 1

    def get_world_size(self) -> int:
        return 2


def test_an_engine_of_several_workers_takes_as_many_ranks():
    # The engine after a two-replica server is worker 3, not 2: it is refused as worker 2.
    sender = BroadcastWeightSender(
        [engine(worker_index=0), TwoWorkers(), engine(worker_index=2)], backend="gloo"
    )
    with pytest.raises(WeightValidationError, match=r"engines\[2\] has worker_index 2, but the "
                       r"engines before it hold 3 workers"):  # fmt: skip
        sender.connect()
    sender.close()


def test_send_before_connect_says_to_connect(policy):
    sender = IPCWeightSender([engine()])
    assert not sender.is_connected
    with pytest.raises(WeightTransferError, match=r"call connect\(\)"):
        sender.send(policy.named_weights())
    sender.close()


def test_gloo_broadcast_reaches_every_engine(policy):
    engines = [engine(0), engine(1)]
    with BroadcastWeightSender(engines, backend="gloo", timeout_s=60) as sender:
        assert sender.is_connected
        stats = sender.send(policy.named_weights(), weight_version="step-1")
        assert stats.num_tensors == len(policy.weight_specs())
        second = sender.send(policy.named_weights(), weight_version="step-2")
    assert not sender.is_connected
    for e in engines:
        assert_holds(e, policy)
        assert e.weight_version == "step-2"
    assert second.num_bytes == stats.num_bytes


def test_ipc_packed_and_in_place(policy):
    target = engine()
    with IPCWeightSender([target], packed=True, bucket_size_bytes=64 << 10) as sender:
        packed = sender.send(policy.named_weights(), weight_version=1)
    assert packed.num_buckets > 1 and packed.direct_buckets == 0
    trainer = LlamaForCausalLM.from_preset("debug", seed=2)
    with IPCWeightSender([target], packed=False) as sender:
        sender.share_module(trainer)
        in_place = sender.send(trainer.named_weights(), weight_version=2)
    assert in_place.direct_buckets == 1
    assert_holds(target, trainer)
    assert target.weight_version == 2


def test_an_engine_rejection_reaches_the_trainer_naming_the_tensor(policy):
    # That a rejected update changes nothing in the engine is test_weight_updates' to show.
    target = engine()
    wrong = [(n, t[..., :1] if n == "lm_head.weight" else t) for n, t in policy.named_weights()]
    with (
        IPCWeightSender([target]) as sender,
        pytest.raises(WeightValidationError, match=r"lm_head\.weight"),
    ):
        sender.send(wrong, weight_version=1)


def test_a_send_refused_by_an_open_transaction_leaves_that_transaction_alone(policy):
    busy, free = engine(), engine()
    with IPCWeightSender([busy, free]) as sender:
        busy.start_weight_update()  # someone else's update, in progress
        with pytest.raises(WeightUpdateStateError, match=r"already in progress"):
            sender.send(policy.named_weights(), weight_version=1)
        assert busy.weight_update is not None  # not aborted by the failed send
        assert free.weight_update is None  # the one this send opened is closed
        busy.abort_weight_update()
        sender.send(policy.named_weights(), weight_version=1)
    assert busy.weight_version == free.weight_version == 1


def test_an_engine_refusing_to_join_fails_connect_at_once_with_its_reason():
    # Forming the group would wait out `timeout_s` for a worker that never comes; the engine's
    # own refusal must end it instead (a timeout would be a WeightTransferTimeout, no reason).
    refusing = LLMEngine(
        "debug",
        engine_config=EngineConfig(num_kv_blocks=64),
        weight_transfer_config=WeightTransferConfig(backend="ipc"),
    )
    sender = BroadcastWeightSender([refusing], backend="gloo", timeout_s=60)
    with pytest.raises(WeightValidationError, match="IPCWeightTransferInitInfo"):
        sender.connect()
    sender.close()


def test_an_engine_that_never_joins_times_out_once_naming_its_rank():
    # A server that takes the connection but never answers: its join neither succeeds nor
    # fails before the group's timeout. The wait for workers and the group's own rendezvous
    # share that one bound (it used to be spent twice), and the error names the missing rank.
    with _ServerThatNeverJoins() as url:
        never = HTTPEngineClient(url, timeout_s=5)
        sender = BroadcastWeightSender([never], backend="gloo", timeout_s=1)
        with pytest.raises(WeightTransferTimeout, match="rank/1 never joined"):
            sender.connect()
        sender.close()
        never.close()


class _ServerThatNeverJoins:
    """A server (a thread) that tells its world size, then takes a join and never answers it."""

    def __enter__(self) -> str:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()
        host, port = self._listener.getsockname()
        return f"http://{host}:{port}"

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self._listener.accept()
                self._held.append(connection)
                if connection.recv(65536).startswith(b"GET /get_world_size"):
                    body = b'{"world_size": 1}'
                    connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                       b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip

    def __exit__(self, *exc_info: object) -> None:
        self._listener.close()
        for connection in self._held:
            connection.close()
