"""A data-parallel front's LoRA loads and unloads over scripted replicas: all or none.

A replica that refuses makes the others undo what they took; an undo that fails leaves the
adapter unloaded from every replica rather than served in different versions.
"""

from types import SimpleNamespace

from fastapi.testclient import TestClient

from weightsync import EngineStateError, ReplicaUnavailableError
from weightsync.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from weightsync.serve._front.app import create_fleet_app
from weightsync.serve._front.fleet import Fleet
from weightsync.serve.config import ServerConfig

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class ScriptedReplica:
    """Holds adapters (name -> directory) as a replica would; refuses the calls it is given."""

    def __init__(self, index: int, adapters: dict[str, str | None], refuses: dict) -> None:
        self.index = index
        self.adapters = dict(adapters)
        self.refuses = refuses
        self.calls: list[tuple[str, dict]] = []
        self.alive = True
        self.open_requests = 0
        self.name = f"replica {index}"
        self.process = SimpleNamespace(pid=1000 + index, exit_status=None)

    async def call(self, method: str, path: str, *, body: dict | None = None, **_: object) -> dict:
        if path == "/v1/models":
            cards = [{"id": name, "root": root} for name, root in self.adapters.items()]
            return {"data": [{"id": "debug"}, *cards]}
        self.calls.append((path, body or {}))
        refusal = self.refuses.get((path, (body or {}).get("lora_path")))
        if refusal is not None:
            raise refusal
        if path == LOAD:
            self.adapters[body["lora_name"]] = body["lora_path"]
        else:
            self.adapters.pop(body["lora_name"])
        return {"text": "Success"}

    def unavailable(self) -> ReplicaUnavailableError:
        return ReplicaUnavailableError(f"{self.name} exited")


def front(adapters: dict[str, str | None], *refuses: dict) -> tuple[TestClient, list]:
    fleet = Fleet.__new__(Fleet)  # the real fleet's logic over scripted replicas
    fleet.timeout_s = 5.0
    fleet.replicas = [ScriptedReplica(i, adapters, r) for i, r in enumerate(refuses)]  # type: ignore[misc]
    config = ServerConfig(model_name="debug", world_size=len(refuses))
    return TestClient(create_fleet_app(fleet, config, enable_lora=True)), fleet.replicas  # type: ignore[return-value]


def refused(path: str, lora_path: str | None, error: Exception) -> dict:
    return {(path, lora_path): error}


def test_a_load_one_replica_refuses_is_unloaded_from_the_others_and_answered_as_one_server():
    bad = LoRAAdapterError("adapter_model.safetensors: tensor x has shape (2, 3), expected (4, 3)")
    client, replicas = front({}, {}, refused(LOAD, "/new", bad), {})
    answer = client.post(LOAD, json={"lora_name": "a", "lora_path": "/new"})
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "LoRAAdapterError"
    assert "tensor x" in answer.json()["error"]["message"]
    assert [r.adapters for r in replicas] == [{}] * 3
    assert [c[0] for c in replicas[0].calls] == [LOAD, UNLOAD]
    assert [c[0] for c in replicas[1].calls] == [LOAD]


def test_a_load_every_replica_refuses_is_the_refusal_and_undoes_nothing():
    bad = LoRAAdapterError("adapter_config.json: r is 64, more than --max-lora-rank 16")
    client, replicas = front({}, refused(LOAD, "/new", bad), refused(LOAD, "/new", bad))
    assert client.post(LOAD, json={"lora_name": "a", "lora_path": "/new"}).status_code == 400
    assert [[c[0] for c in r.calls] for r in replicas] == [[LOAD]] * 2


def test_an_inplace_load_one_replica_refuses_reloads_the_previous_directory_on_the_others():
    bad = LoRAAdapterError("adapter_model.safetensors: tensor x is missing")
    client, replicas = front({"a": "/old"}, {}, refused(LOAD, "/new", bad))
    answer = client.post(LOAD, json={"lora_name": "a", "lora_path": "/new", "load_inplace": True})
    assert answer.status_code == 400
    assert [r.adapters for r in replicas] == [{"a": "/old"}] * 2
    assert replicas[0].calls[-1] == (LOAD, {"lora_name": "a", "lora_path": "/old",
                                            "load_inplace": True})  # fmt: skip


def test_an_unload_one_replica_refuses_is_loaded_back_on_the_others():
    gone = LoRAAdapterNotFoundError("The lora adapter 'a' cannot be found.")
    client, replicas = front({"a": "/old"}, refused(UNLOAD, None, gone), {})
    answer = client.post(UNLOAD, json={"lora_name": "a"})
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "LoRAAdapterNotFoundError"
    assert [r.adapters for r in replicas] == [{"a": "/old"}] * 2
    assert [c[0] for c in replicas[1].calls] == [UNLOAD, LOAD]


def test_an_undo_that_fails_unloads_the_adapter_from_every_replica_and_says_so():
    bad = LoRAAdapterError("adapter_model.safetensors: tensor x is missing")
    moved = LoRAAdapterNotFoundError("no adapter found at /old")
    client, replicas = front({"a": "/old"}, {**refused(LOAD, "/old", moved)},
                             refused(LOAD, "/new", bad))  # fmt: skip
    answer = client.post(LOAD, json={"lora_name": "a", "lora_path": "/new", "load_inplace": True})
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert error["type"] == EngineStateError.__name__
    assert "tensor x is missing" in error["message"]  # the refusal
    assert "undoing it on replica 0 failed" in error["message"] and "/old" in error["message"]
    assert "load it again" in error["message"]
    assert [r.adapters for r in replicas] == [{}] * 2  # no replica serves a version of 'a'


def test_an_inplace_load_over_a_live_updated_adapter_cannot_be_undone_so_none_serves_it():
    bad = LoRAAdapterError("adapter_model.safetensors: tensor x is missing")
    client, replicas = front({"a": None}, {}, refused(LOAD, "/new", bad))
    answer = client.post(LOAD, json={"lora_name": "a", "lora_path": "/new", "load_inplace": True})
    assert answer.status_code == 409
    assert "built by a live update" in answer.json()["error"]["message"]
    assert [r.adapters for r in replicas] == [{}] * 2
