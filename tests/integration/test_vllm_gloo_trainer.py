"""A TRL-style trainer loop, vLLM's two NCCL helpers swapped for `weightsync.trainer.vllm_gloo`.

`TRLStyleClient` makes the calls TRL 1.16's `VLLMClient` makes against a vLLM >= 0.28 server
(`init_communicator`, `update_named_params`, `weight_update`, `close_communicator`), in the same
order and with the same payloads; only its two vLLM imports are swapped.
"""

import atexit
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import torch
from serve_support import Server

from weightsync import LlamaForCausalLM, weight_checksums
from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.trainer.vllm_gloo import packed_nccl_broadcast_producer
from weightsync.trainer.vllm_gloo import trainer_init as open_trainer_endpoint

WAIT_S = 120


class TRLStyleClient:
    def __init__(self, base_url: str, group_port: int) -> None:
        self.base_url = base_url
        self.group_port = group_port
        self.communicator = None
        self._updating_weights = False

    def _post(self, url, **kwargs):
        response = httpx.post(url, timeout=WAIT_S, **kwargs)
        response.raise_for_status()
        return response.json()

    def init_communicator(self) -> None:
        world_size = httpx.get(f"{self.base_url}/get_world_size").json()["world_size"] + 1
        init_info = {
            "master_address": "127.0.0.1",  # TRL: vllm.utils.network_utils.get_ip()
            "master_port": self.group_port,
            "rank_offset": 1,
            "world_size": world_size,
            "packed": True,
        }
        with ThreadPoolExecutor(max_workers=1) as executor:
            future = executor.submit(
                self._post,
                f"{self.base_url}/init_weight_transfer_engine",
                json={"init_info": init_info},
            )
            self.communicator = open_trainer_endpoint(init_info)
            future.result()
        atexit.register(self.close_communicator)

    @contextmanager
    def weight_update(self):
        self._post(f"{self.base_url}/start_weight_update", json={})
        self._updating_weights = True
        try:
            yield
        finally:
            self._updating_weights = False
            self._post(f"{self.base_url}/finish_weight_update", json={})

    def update_named_params(self, metadata, named_params: Iterator) -> None:
        names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
        update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
        if not self._updating_weights:
            self._post(f"{self.base_url}/start_weight_update", json={})
        with ThreadPoolExecutor(max_workers=1) as executor:
            future = executor.submit(
                self._post, f"{self.base_url}/update_weights", json={"update_info": update_info}
            )
            packed_nccl_broadcast_producer(
                iterator=named_params,
                group=self.communicator,
                src=0,
                post_iter_func=lambda item: item[1],
            )
            future.result()
        if not self._updating_weights:
            self._post(f"{self.base_url}/finish_weight_update", json={})

    def update_model_params(self, named_parameters) -> None:
        pairs = list(named_parameters)
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in pairs]
        self.update_named_params(metadata, ((n, p.data) for n, p in pairs))

    def close_communicator(self) -> None:
        if self.communicator is not None:
            self.communicator.group.store = None
            self.communicator.group.socket = None
            self.communicator = None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--weight-transfer-config", '{"backend": "gloo"}')
    yield server
    server.kill()


def matches(url: str, policy: LlamaForCausalLM) -> bool:
    baseline = weight_checksums(policy.named_weights())
    answer = httpx.post(
        f"{url}/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=WAIT_S
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["match"]


def test_a_trl_style_trainer_loop_updates_the_server_over_gloo(server):
    url = server.base_url
    client = TRLStyleClient(url, free_port())
    client.init_communicator()
    policy = LlamaForCausalLM.from_preset("debug", seed=7)
    for step in range(1, 3):
        with torch.no_grad():
            for _, weight in policy.named_weights():
                weight.add_(0.01 * step)  # a "training step"
        client.update_model_params(policy.named_weights())  # one transaction per call
        assert matches(url, policy)
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == step
    with client.weight_update():  # several calls, one transaction
        pairs = list(policy.named_weights())
        for name, weight in pairs[:2]:
            meta = [(name, str(weight.dtype).removeprefix("torch."), list(weight.shape))]
            client.update_named_params(meta, iter([(name, weight)]))
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] == 3
    with pytest.raises(WeightValidationError, match="buffer_size_bytes=4096 differs"):
        packed_nccl_broadcast_producer(
            iter([]), client.communicator, 0, lambda item: item[1], buffer_size_bytes=4096
        )
    group = client.communicator.trainer_group
    client.close_communicator()
    with pytest.raises(WeightTransferError, match="closed"):  # TRL's close released the group
        group.connect()


def test_the_stand_in_refuses_a_foreign_group_and_another_rank_offset():
    with pytest.raises(WeightValidationError, match="group must be the communicator"):
        packed_nccl_broadcast_producer(iter([]), object(), 0, lambda item: item[1])
    with pytest.raises(WeightValidationError, match="rank_offset must be 1"):
        open_trainer_endpoint({"master_address": "127.0.0.1", "master_port": free_port(),
                               "world_size": 2, "rank_offset": 2})  # fmt: skip
