"""The data-parallel front's RL routes over scripted replicas: all or none, never half-paused."""

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from weightsync import (
    EngineTimeoutError,
    IncompleteWeightUpdateError,
    ReplicaUnavailableError,
    TornWeightsError,
)
from weightsync.serve._fleet import Fleet
from weightsync.serve._fleet_app import create_fleet_app
from weightsync.serve.app import ServerConfig


class ScriptedReplica:
    """Answers every call with `{}`-like bodies, except the failures it is given."""

    def __init__(self, index: int, failures: dict[str, Exception]) -> None:
        self.index = index
        self.failures = failures
        self.calls: list[str] = []
        self.alive = True
        self.open_requests = 0
        self.name = f"replica {index}"
        self.process = SimpleNamespace(pid=1000 + index)

    async def call(self, method: str, path: str, **_: object) -> dict:
        self.calls.append(path)
        if path in self.failures:
            raise self.failures[path]
        return {"aborted": False, "stats": {"num_bytes": 1}, "is_paused": True}

    def unavailable(self) -> ReplicaUnavailableError:
        return ReplicaUnavailableError(f"{self.name} exited")


def front(*failures: dict[str, Exception]) -> tuple[TestClient, list[ScriptedReplica]]:
    fleet = Fleet.__new__(Fleet)  # the real fleet's logic over scripted replicas
    fleet.timeout_s = 5.0
    fleet.replicas = [ScriptedReplica(i, f) for i, f in enumerate(failures)]  # type: ignore[misc]
    app = create_fleet_app(fleet, ServerConfig(model_name="debug", world_size=len(failures)))
    return TestClient(app), fleet.replicas  # type: ignore[return-value]


def test_finish_commits_on_none_when_one_replica_would_refuse():
    client, replicas = front(
        {}, {"/prepare_weight_update": TornWeightsError("replica 1: torn")}, {}
    )
    answer = client.post("/finish_weight_update", json={"weight_version": 3})
    assert answer.status_code == 409
    assert answer.json()["error"]["type"] == "TornWeightsError"
    assert "replica 1" in answer.json()["error"]["message"]
    # Only the replica refused for torn weights is told to finish, which it refuses in turn
    # (as one engine's finish does); those that would have committed abort: no version moves.
    assert all(r.calls[0] == "/prepare_weight_update" for r in replicas)
    assert replicas[1].calls[-1] == "/finish_weight_update"
    assert [replicas[0].calls[-1], replicas[2].calls[-1]] == ["/abort_weight_update"] * 2
    assert not any("/finish_weight_update" in r.calls for r in (replicas[0], replicas[2]))


def test_finish_commits_on_every_replica_once_all_are_ready():
    client, replicas = front({}, {})
    assert client.post("/finish_weight_update", json={"weight_version": 3}).status_code == 200
    assert [r.calls for r in replicas] == [["/prepare_weight_update", "/finish_weight_update"]] * 2


def test_a_replica_that_misses_the_pause_fails_it_by_name_and_the_others_stay_paused():
    client, replicas = front({}, {"/pause": EngineTimeoutError("replica 1 did not answer")}, {})
    answer = client.post("/pause", params={"mode": "keep"})
    assert answer.status_code == 409
    assert "replica 1" in answer.json()["error"]["message"]
    assert [r.calls for r in replicas] == [["/pause"]] * 3  # nobody was resumed behind its back


def test_a_bare_update_is_a_transaction_on_every_replica_finished_when_whole():
    client, replicas = front({}, {})
    answer = client.post("/update_weights", json={"update_info": {"names": []}})
    assert answer.status_code == 200
    assert answer.json()["stats"] == {"num_bytes": 1}
    expected = ["/start_weight_update", "/update_weights", "/prepare_weight_update",
                "/finish_weight_update"]  # fmt: skip
    assert [r.calls for r in replicas] == [expected] * 2


def test_a_bare_update_with_parts_to_come_stays_open_on_every_replica():
    part = IncompleteWeightUpdateError("replica 0: 2 announced weights have not landed")
    client, replicas = front({"/prepare_weight_update": part}, {})
    assert client.post("/update_weights", json={"update_info": {"names": []}}).status_code == 200
    assert not any("/finish_weight_update" in r.calls for r in replicas)
    assert client.app.state.serve.transaction == "implicit"


@pytest.mark.parametrize("path", ["/pause", "/resume", "/start_weight_update"])
def test_a_dead_replica_makes_rl_routes_answer_503_before_any_call(path):
    client, replicas = front({}, {})
    replicas[1].alive = False
    answer = client.post(path)
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "ReplicaUnavailableError"
    assert not any(r.calls for r in replicas)
