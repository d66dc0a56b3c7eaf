"""The data-parallel front's control over scripted replicas: all or none, never half-paused."""

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from weightsync import (
    EngineTimeoutError,
    IncompleteWeightUpdateError,
    ReplicaUnavailableError,
    TornWeightsError,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.serve._front.app import create_fleet_app
from weightsync.serve._front.fleet import Fleet
from weightsync.serve.config import ServerConfig

BARE_COMPLETE = {"explicit": False, "complete": True, "num_announced": 1, "num_landed": 1}
BARE_OPEN = {**BARE_COMPLETE, "complete": False, "num_landed": 0}
EXPLICIT_COMPLETE = {**BARE_COMPLETE, "explicit": True}


class ScriptedReplica:
    """Answers every call with `{}`-like bodies, except the failures it is given."""

    def __init__(self, index: int, failures: dict[str, Exception], update: dict | None) -> None:
        self.index = index
        self.failures = failures
        self.update = update
        self.calls: list[str] = []
        self.alive = True
        self.open_requests = 0
        self.name = f"replica {index}"
        self.process = SimpleNamespace(pid=1000 + index, exit_status=None)

    async def call(self, method: str, path: str, **_: object) -> dict:
        self.calls.append(path)
        if path in self.failures:
            raise self.failures[path]
        return {"aborted": False, "stats": {"num_bytes": 1}, "is_paused": True,
                "weight_update": self.update}  # fmt: skip

    def unavailable(self) -> ReplicaUnavailableError:
        return ReplicaUnavailableError(f"{self.name} exited")


def front(
    *failures: dict[str, Exception], update: dict | None = None
) -> tuple[TestClient, list[ScriptedReplica]]:
    fleet = Fleet.__new__(Fleet)  # the real fleet's logic over scripted replicas
    fleet.timeout_s = 5.0
    fleet.replicas = [ScriptedReplica(i, f, update) for i, f in enumerate(failures)]  # type: ignore[misc]
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
    # The replicas disagree: the update ends on every one of them, and no version moves.
    assert [r.calls for r in replicas] == [["/prepare_weight_update", "/abort_weight_update"]] * 3


def test_finish_refused_by_every_replica_ends_on_each_as_one_engines_finish_would():
    torn = TornWeightsError("torn")
    client, replicas = front(*[{"/prepare_weight_update": torn, "/finish_weight_update": torn}] * 2)
    answer = client.post("/finish_weight_update", json={"weight_version": 3})
    assert answer.status_code == 409
    assert [r.calls for r in replicas] == [["/prepare_weight_update", "/finish_weight_update"]] * 2


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


def test_a_bare_update_that_completes_everywhere_is_committed_on_every_replica():
    client, replicas = front({}, {}, update=BARE_COMPLETE)
    answer = client.post("/update_weights", json={"update_info": {"names": []}})
    assert answer.status_code == 200
    assert answer.json()["stats"] == {"num_bytes": 1}
    assert answer.json()["weight_update"] is None  # finished
    expected = ["/update_weights", "/prepare_weight_update", "/finish_weight_update"]
    assert [r.calls for r in replicas] == [expected] * 2


@pytest.mark.parametrize("update", [BARE_OPEN, EXPLICIT_COMPLETE])
def test_an_update_with_parts_to_come_or_an_explicit_one_is_not_committed(update):
    client, replicas = front({}, {}, update=update)
    answer = client.post("/update_weights", json={"update_info": {"names": []}})
    assert answer.status_code == 200
    assert answer.json()["weight_update"] == update
    assert [r.calls for r in replicas] == [["/update_weights"]] * 2


def test_a_message_some_replicas_refused_ends_the_update_on_all_of_them():
    refused = WeightValidationError("replica 1: refused")
    client, replicas = front({}, {"/update_weights": refused}, update=BARE_OPEN)
    answer = client.post("/update_weights", json={"update_info": {"names": []}})
    assert answer.status_code == 400
    assert [r.calls for r in replicas] == [["/update_weights", "/abort_weight_update"]] * 2


def test_a_message_every_replica_refused_changes_nothing():
    refused = WeightValidationError("refused")
    client, replicas = front(*[{"/update_weights": refused}] * 2)
    assert client.post("/update_weights", json={"update_info": {}}).status_code == 400
    assert [r.calls for r in replicas] == [["/update_weights"]] * 2


@pytest.mark.parametrize("path", ["/pause", "/resume", "/start_weight_update", "/update_weights"])
def test_a_dead_replica_makes_rl_routes_answer_503_before_any_call(path):
    client, replicas = front({}, {})
    replicas[1].alive = False
    body = {"update_info": {}} if path == "/update_weights" else None
    answer = client.post(path, json=body)
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "ReplicaUnavailableError"
    assert not any(r.calls for r in replicas)


def test_abort_and_health_answer_with_a_dead_replica_and_name_it():
    client, replicas = front({}, {}, {})
    replicas[1].alive = False
    assert client.post("/abort_weight_update").status_code == 200
    assert [r.calls for r in replicas] == [["/abort_weight_update"], [], ["/abort_weight_update"]]
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert "replica 1" in health.json()["message"]
    assert [r["alive"] for r in health.json()["replicas"]] == [True, False, True]


def test_an_incomplete_finish_everywhere_keeps_the_update_open_everywhere():
    part = IncompleteWeightUpdateError("2 announced weights have not landed")
    client, replicas = front(*[{"/prepare_weight_update": part, "/finish_weight_update": part}] * 2)
    assert client.post("/finish_weight_update").status_code == 409
    assert not any("/abort_weight_update" in r.calls for r in replicas)


def test_a_start_one_replica_refuses_is_ended_only_where_this_call_opened_it():
    # The refusing replica may hold an update of its own: it is not this call's to end.
    busy = WeightUpdateStateError("replica 1: a weight update is already in progress")
    client, replicas = front({}, {"/start_weight_update": busy})
    assert client.post("/start_weight_update").status_code == 409
    assert [r.calls for r in replicas] == [
        ["/start_weight_update", "/abort_weight_update"], ["/start_weight_update"]
    ]  # fmt: skip
