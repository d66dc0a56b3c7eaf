"""A trainer written the way vLLM's HTTP weight-sync example is: plain HTTP calls to the RL routes,
and the trainer's end of the broadcast from the library. Usage: vllm_style_trainer.py BASE_URL.

It prints one JSON line: the weight version the server reports, and the greedy completion.
"""

import json
import sys
import threading

import httpx

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)

BASE_URL = sys.argv[1] if __name__ == "__main__" else "http://127.0.0.1:8000"


def post(path, **kwargs):
    response = httpx.post(f"{BASE_URL}{path}", timeout=120, **kwargs)
    response.raise_for_status()
    return response.json()


def main() -> None:
    world_size = httpx.get(f"{BASE_URL}/get_world_size").json()["world_size"]
    group = trainer_init(world_size=world_size + 1, backend="gloo", timeout_s=60)
    joining = threading.Thread(
        target=post,
        args=("/init_weight_transfer_engine",),
        kwargs={"json": {"init_info": group.init_info}},
    )
    joining.start()
    group.connect()
    joining.join()

    policy = LlamaForCausalLM.from_preset("debug", seed=7)  # the "trained" weights
    for step in (1, 2):
        pairs = list(policy.named_weights())
        update_info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
        assert post("/pause", params={"mode": "keep"}) == {"status": "paused"}
        assert post("/start_weight_update") == {"message": "Weight update started"}
        receiving = threading.Thread(
            target=post, args=("/update_weights",), kwargs={"json": {"update_info": update_info}}
        )
        receiving.start()
        trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, update_info))
        receiving.join()
        post("/finish_weight_update", json={"weight_version": f"step-{step}"})
        assert post("/resume") == {"status": "resumed"}
    group.close()

    version = httpx.get(f"{BASE_URL}/weight_info").json()["weight_version"]
    completion = post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0}
    )
    print(json.dumps({"weight_version": version, "text": completion["choices"][0]["text"]}))


if __name__ == "__main__":
    main()
