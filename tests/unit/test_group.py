"""The broadcast group's own checks and its store, in one process (rank 0 only: no peer)."""

import pytest
import torch

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer.group import BroadcastGroup, check_backend, check_port, translate


def _group(**overrides):
    kwargs = {
        "backend": "gloo",
        "master_address": "127.0.0.1",
        "master_port": 0,
        "rank": 0,
        "world_size": 2,
        "timeout_s": 5.0,
        **overrides,
    }
    return BroadcastGroup(**kwargs)


@pytest.mark.parametrize("port", [-1, 65536, True, 1.0, "80"])
def test_check_port_refuses_what_is_not_a_tcp_port(port):
    with pytest.raises(WeightValidationError, match="master_port must be an int in 0-65535"):
        check_port(port)


def test_check_port_takes_zero_only_where_a_free_port_may_be_picked():
    assert check_port(0) == 0 and check_port(65535) == 65535
    with pytest.raises(WeightValidationError, match="in 1-65535, got 0"):
        check_port(0, allow_zero=False)


def test_check_backend():
    assert check_backend("gloo") == torch.device("cpu")
    with pytest.raises(WeightValidationError, match="backend must be one of"):
        check_backend("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(WeightValidationError, match="backend 'nccl' needs CUDA"):
            check_backend("nccl")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"world_size": 1}, "world_size must be an int >= 2"),
        ({"rank": 2}, r"rank must be in \[0, world_size=2\)"),
        ({"timeout_s": float("nan")}, "timeout_s must be a finite number"),
        ({"master_port": 70000}, "master_port must be an int in 0-65535"),
    ],
)
def test_group_checks_its_arguments_before_opening_a_store(overrides, message):
    with pytest.raises(WeightValidationError, match=message):
        _group(**overrides)


def test_store_round_trips_json_and_a_rank_is_claimed_by_one_claimant():
    group = _group()
    try:
        assert group.port > 0
        group.set("wire", {"packed": True, "n": [1, 2]})
        assert group.get("wire") == {"packed": True, "n": [1, 2]}
        assert group.try_get("missing") is None
        group.claim_rank("engine-a")
        group.claim_rank("engine-a")  # the same engine retrying its join
        with pytest.raises(WeightValidationError, match="rank 0 was claimed by another process"):
            group.claim_rank("engine-b")
        assert not group.is_connected
    finally:
        group.close()


def test_reading_a_key_nobody_writes_times_out_as_a_weightsync_error():
    group = _group()
    try:
        with pytest.raises(WeightTransferTimeout, match=r"reading 'never' .* timed out"):
            group.get("never", timeout_s=0.05)
    finally:
        group.close()


def test_collectives_need_a_connected_group():
    group = _group()
    try:
        with pytest.raises(WeightTransferError, match="not connected"):
            group.broadcast(torch.zeros(1), "a test")
    finally:
        group.close()


def test_torch_failures_become_weightsync_errors():
    timeout = translate("receiving bucket", RuntimeError("Socket Timeout"), 3.0)
    assert isinstance(timeout, WeightTransferTimeout)
    assert "receiving bucket timed out after 3 s (timeout_s)" in str(timeout)
    failed = translate("receiving bucket", RuntimeError("Connection reset by peer"), 3.0)
    misnamed = translate("opening the store", TypeError("unexpected keyword 'timeout'"), 3.0)
    assert not isinstance(misnamed, WeightTransferTimeout)
    assert type(failed) is WeightTransferError
    assert "a peer process died or closed the group" in str(failed)


def test_a_torch_failure_keeps_its_first_line_and_leaves_its_cpp_frames_to_the_cause():
    torch_text = ("Failed to recv, got 0 bytes.\nException raised from recvBytes at Utils.hpp:787 "
                  "(most recent call first):\nframe #0: c10::Error::Error(...) + 0x9d")  # fmt: skip
    for cause in (RuntimeError(torch_text), RuntimeError("Socket Timeout\n" + torch_text)):
        error = translate("reading 'latest'", cause, 3.0)
        assert "\n" not in str(error) and "frame #" not in str(error)
        assert str(cause).splitlines()[0] in str(error)


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        ([1, 2], r"holds no trainer's wire parameters \(got list\)"),
        ({"packed": False}, r"init_info disagrees with the trainer's group \(.*packed"),
    ],
)
def test_a_worker_checks_the_wire_parameters_it_reads_from_the_store(wire, message):
    from weightsync import GlooWeightTransferEngine
    from weightsync.transfer.base import WireParams
    from weightsync.transfer.nccl import NCCLWeightTransferInitInfo

    trainer = _group()  # rank 0 hosts the store; a hostile or foreign one writes what it likes
    trainer.set("wire", wire)
    info = NCCLWeightTransferInitInfo.create(
        master_address="127.0.0.1",
        master_port=trainer.port,
        world_size=2,
        backend="gloo",
        wire=WireParams(timeout_s=5.0),
    )
    engine = GlooWeightTransferEngine()
    try:
        with pytest.raises(WeightValidationError, match=message):
            engine.init_transfer_engine(info)
        assert not engine.is_initialized
    finally:
        trainer.close()


def _listening_addresses(port):
    """Local addresses with a socket listening on `port`, from the kernel's own tables."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.rsplit(":", 1)
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_the_trainer_store_listens_on_master_address_only():
    group = _group()
    try:
        # 0100007F is 127.0.0.1 as the kernel writes it; every interface would be 00000000 (or ::).
        assert _listening_addresses(group.port) == {"0100007F"}
    finally:
        group.close(release_store=True)


def test_the_store_port_is_free_again_right_after_close():
    import socket

    group = _group()
    port = group.port
    group.set("wire", {"packed": True})  # a served request: its connection must not pin the port
    group.close(release_store=True)
    assert _listening_addresses(port) == set()
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))  # would raise EADDRINUSE while the store listened


def test_trainer_init_close_releases_the_port():
    from weightsync.transfer.nccl import trainer_init

    trainer = trainer_init(world_size=2, backend="gloo")
    port = trainer.init_info["master_port"]
    assert _listening_addresses(port) == {"0100007F"}
    trainer.close()
    assert _listening_addresses(port) == set()


def test_an_ipv6_master_address_where_ipv6_cannot_take_ipv4_peers_gets_a_plain_listener(
    monkeypatch,
):
    import socket

    monkeypatch.setattr(socket, "has_dualstack_ipv6", lambda: False)  # a host without dual stack
    group = _group(master_address="::1")
    try:
        assert _listening_addresses(group.port) == {"00000000000000000000000001000000"}  # ::1
    finally:
        group.close(release_store=True)


def test_a_taken_port_is_a_weightsync_error_naming_it():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(WeightTransferError, match=f"master_port {port}: .*pick a free port"):
            _group(master_port=port)


def test_an_address_that_does_not_resolve_is_a_weightsync_error():
    with pytest.raises(WeightTransferError, match=r"master_address 'no-such-host\.invalid'"):
        _group(master_address="no-such-host.invalid")


def test_a_store_that_stops_answering_is_a_timeout_not_a_hang():
    import threading

    release = threading.Event()

    class StoppedStore:  # a trainer under SIGSTOP: its socket is open, nothing answers
        def check(self, keys):
            release.wait(30)
            return False

        get = wait = compare_set = check

    group = _group(timeout_s=0.3)
    real, group._store = group._store, StoppedStore()
    try:
        assert group.try_get("abort/1") is None  # bounded: a note nobody can read is skipped
        with pytest.raises(WeightTransferTimeout, match="stopped answering earlier"):
            group.get("wire")
    finally:
        release.set()
        group._store = real
        group.close(release_store=True)


@pytest.mark.reliability("bad-input")
def test_a_world_size_no_group_can_have_is_refused_at_once(record_property):
    """`trainer_init(world_size=10**6)`: refused at once, naming the limit and why it is one."""
    import re
    import time

    from weightsync import GlooWeightTransferEngine
    from weightsync.transfer.base import WireParams
    from weightsync.transfer.nccl import NCCLWeightTransferInitInfo, trainer_init

    start = time.monotonic()
    with pytest.raises(WeightValidationError, match=r"RLIMIT_NOFILE") as refused:
        trainer_init(world_size=10**6, backend="gloo", timeout_s=5)
    assert time.monotonic() - start < 5  # refused before anything waited
    message = str(refused.value)
    assert "world_size 1000000 is more than any group" in message and "ulimit -n" in message
    limit = int(re.search(r"world_size can be at most (\d+)", message).group(1))
    trainer_init(world_size=limit, backend="gloo").close()  # the limit itself is a group
    with pytest.raises(WeightValidationError, match=f"at most {limit}"):
        trainer_init(world_size=limit + 1, backend="gloo")
    # A worker told such a world size (a hostile init info, say) refuses before connecting.
    info = NCCLWeightTransferInitInfo.create(
        master_address="127.0.0.1",
        master_port=9,  # nothing listens: a worker that tried to connect would time out
        world_size=10**6,
        backend="gloo",
        wire=WireParams(timeout_s=5.0),
    )
    with pytest.raises(WeightValidationError, match="RLIMIT_NOFILE"):
        GlooWeightTransferEngine().init_transfer_engine(info)
    record_property("error", "WeightValidationError")
    record_property("message", message[:160])


@pytest.mark.reliability("fault")
def test_connect_keeps_one_timeout_for_every_phase(record_property):
    """No worker ever joins the largest group allowed: `connect` fails within its `timeout_s`."""
    import re
    import time

    from weightsync.transfer.nccl import trainer_init

    with pytest.raises(WeightValidationError) as refused:
        trainer_init(world_size=10**9, backend="gloo")
    limit = int(re.search(r"at most (\d+)", str(refused.value)).group(1))
    timeout_s = 1.0
    group = trainer_init(world_size=limit, backend="gloo", timeout_s=timeout_s)
    try:
        start = time.monotonic()
        with pytest.raises(WeightTransferTimeout, match=r"timed out after 1 s \(timeout_s\)"):
            group.connect()
        elapsed = time.monotonic() - start
    finally:
        group.close()
    # Rendezvous and the report of the workers' errors share the one limit: reading what
    # thousands of ranks reported, one store read each, used to come on top of it.
    assert elapsed < timeout_s + 1.5, elapsed
    record_property("error", "WeightTransferTimeout")
    record_property("seconds_to_error", round(elapsed, 2))


@pytest.mark.reliability("fault")
def test_waiting_for_workers_and_the_rendezvous_share_one_timeout(record_property):
    """A worker claims its rank late and never forms the group: `connect` ends at `timeout_s`."""
    import threading
    import time
    from concurrent.futures import Future

    from weightsync.transfer.nccl import trainer_init

    timeout_s = 2.0
    group = trainer_init(world_size=2, backend="gloo", timeout_s=timeout_s)
    # Half the limit in, a worker claims rank 1 and then never comes to the rendezvous.
    late = threading.Timer(timeout_s / 2, lambda: group._group.set("rank/1", "late-worker"))
    try:
        start = time.monotonic()
        late.start()
        with pytest.raises(WeightTransferTimeout, match=r"timed out after 2 s \(timeout_s\)"):
            group.connect(joining=[Future()])  # a join call that never returns
        elapsed = time.monotonic() - start
    finally:
        late.cancel()
        group.close()
    assert elapsed < timeout_s * 1.25, elapsed  # was: half the limit, then the whole limit again
    record_property("seconds_to_error", round(elapsed, 2))


def test_a_store_call_that_dies_of_a_base_exception_raises_it_and_leaves_the_store_usable():
    class Dying(BaseException):  # not an Exception: what a store call's thread may die of
        pass

    class DyingStore:
        def check(self, keys):
            raise Dying("the store call's thread died")

    group = _group(timeout_s=1.0)
    real, group._store = group._store, DyingStore()
    try:
        with pytest.raises(Dying, match="thread died"):  # not a timeout naming a stuck trainer
            group.lookup("wire")
        group._store = real
        group.set("wire", {"packed": True})
        assert group.lookup("wire") == {"packed": True}  # the store was never marked stuck
    finally:
        group._store = real
        group.close(release_store=True)


def test_a_rank_that_gives_up_does_not_wait_out_a_stopped_store_again():
    """A bucket timed out because the trainer stopped (SIGSTOP): the note of why this rank gives
    up, and the peers' notes it quotes, are best effort, so the error comes seconds after the
    timeout, not a second timeout later (past the trainer's HTTP client's own bound)."""
    import threading
    import time

    from weightsync.transfer import nccl

    release = threading.Event()

    class StoppedStore:  # the trainer's store under SIGSTOP: writes are buffered, reads hang
        def set(self, key, value):
            pass

        def check(self, keys):
            release.wait(60)

        get = wait = compare_set = check

    group = _group(timeout_s=30.0)
    real, group._store = group._store, StoppedStore()
    try:
        start = time.monotonic()
        error = nccl._transfer_failed(
            group, WeightTransferTimeout("receiving bucket 2 timed out"), partially_applied=True
        )
        assert time.monotonic() - start < group.timeout_s  # the note's own short limit
        assert isinstance(error, WeightTransferTimeout) and error.partially_applied
        assert "receiving bucket 2 timed out" in str(error) and "the group is closed" in str(error)
    finally:
        release.set()
        group._store = real
        group.close(release_store=True)
