"""Adapter-only sync over HTTP: `lora_name` in `/start_weight_update`'s body, the finish answer
naming the adapter's version and what was dropped, and a data-parallel front passing both on."""

from types import SimpleNamespace

import torch
from fastapi.testclient import TestClient

from weightsync import AsyncEngine, EngineConfig
from weightsync.serve import ServerConfig, create_app
from weightsync.serve._front.app import create_fleet_app
from weightsync.serve._front.fleet import Fleet
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

MODULES = ["q_proj", "v_proj"]
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": MODULES}


def test_an_adapter_is_pushed_through_the_routes_and_the_finish_names_its_version():
    engine = AsyncEngine("debug", engine_config=EngineConfig(num_kv_blocks=64, enable_lora=True))
    specs = engine.engine.weights.adapters.adapter_specs("a", CONFIG)
    tensors = [(s.name, torch.full(s.shape, 0.01, dtype=s.dtype)) for s in specs.values()]
    session = ipc_trainer_init()
    with TestClient(create_app(engine, ServerConfig(model_name="debug"))) as client:
        assert client.post("/init_weight_transfer_engine",
                           json={"init_info": session.init_info}).status_code == 200  # fmt: skip
        started = client.post(
            "/start_weight_update", json={"lora_name": "a", "lora_config": CONFIG}
        )
        assert started.json() == {"message": "Weight update started", "lora_name": "a"}

        def deliver(update_info):
            answer = client.post("/update_weights", json={"update_info": update_info})
            assert answer.status_code == 200, answer.json()
            assert answer.json()["weight_update"]["lora_name"] == "a"

        ipc_trainer_send_weights(tensors, IPCTrainerSendWeightsArgs(session, deliver))
        finished = client.post("/finish_weight_update", json={"weight_version": "step-1"}).json()
        assert finished == {"message": "Weight update finished", "applied": True,
                            "lora_name": "a", "weight_version": "step-1",
                            "dropped_versions": []}  # fmt: skip
        assert client.get("/weight_info").json()["weight_version"] == 0  # the model's stays
        # A config without a name, and an adapter the server does not hold: refused by name.
        refused = client.post("/start_weight_update", json={"lora_config": CONFIG})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_config"
        named_as_the_model = {"lora_name": "debug", "lora_config": CONFIG}
        refused = client.post("/start_weight_update", json=named_as_the_model)
        assert refused.status_code == 400 and "conflicts with a served base model" in refused.text
        unknown = client.post("/start_weight_update", json={"lora_name": "b"})
        assert unknown.json()["error"]["type"] == "LoRAAdapterNotFoundError"
        assert "'b' is not loaded" in unknown.json()["error"]["message"]
        # vLLM's start, with no body, still opens an update of the model's weights.
        assert client.post("/start_weight_update").json() == {"message": "Weight update started"}
        assert client.post("/abort_weight_update").json()["aborted"] is True
    session.close()
    assert engine.engine.loras.get("a").weight_version == "step-1"


class AdapterReplica:
    """A replica that records each call's body and answers an adapter's finish."""

    def __init__(self, index: int, dropped: list) -> None:
        self.index, self.dropped, self.alive, self.open_requests = index, dropped, True, 0
        self.name = f"replica {index}"
        self.process = SimpleNamespace(pid=1000 + index, exit_status=None)
        self.calls: list[tuple[str, object]] = []

    async def call(self, method: str, path: str, *, body=None, **_: object) -> dict:
        self.calls.append((path, body))
        if path == "/finish_weight_update":
            return {"applied": True, "lora_name": "a", "weight_version": 3,
                    "dropped_versions": self.dropped}  # fmt: skip
        return {"aborted": False}

    async def close(self) -> None:
        self.alive = False


def test_the_front_passes_lora_name_on_and_says_what_any_replica_dropped():
    fleet = Fleet.__new__(Fleet)
    fleet.timeout_s = 5.0
    fleet.replicas = [AdapterReplica(0, [1]), AdapterReplica(1, [1])]  # type: ignore[misc]
    app = create_fleet_app(fleet, ServerConfig(model_name="debug", world_size=2))
    body = {"lora_name": "a", "lora_config": CONFIG}
    with TestClient(app) as client:  # one event loop for every call
        assert client.post("/start_weight_update", json=body).status_code == 200
        finished = client.post("/finish_weight_update", json={"weight_version": 3}).json()
    assert finished["lora_name"] == "a" and finished["dropped_versions"] == [1]
    for replica in fleet.replicas:
        assert replica.calls[0] == ("/start_weight_update", body)
        # Checked on every replica before any commits, as a full update is.
        assert [path for path, _ in replica.calls[1:3]] == [
            "/prepare_weight_update",
            "/finish_weight_update",
        ]
