"""The ipc backend on CUDA: CUDA IPC handles from a trainer process to receivers on the same GPU."""

import json

import pytest
import torch

from ipc_rigs import IPCReceiverProcess, IPCTrainerProcess
from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)
from weightsync.transfer.memory import cuda_device_uuids

pytestmark = pytest.mark.gpu

SPECS = [
    TensorSpec("embed.weight", torch.bfloat16, (1024, 256)),
    TensorSpec("norm.weight", torch.float32, (256,)),
    TensorSpec("scale", torch.float8_e4m3fn, (77,)),
    TensorSpec("step", torch.int64, ()),
    TensorSpec("empty", torch.float16, (0, 8)),
    TensorSpec("mask", torch.bool, (33,)),
    TensorSpec("head.weight", torch.bfloat16, (1024, 256)),
]
INFO = WeightTransferUpdateInfo.from_specs(SPECS).to_dict()


@pytest.mark.parametrize("packed", [True, False])
def test_cuda_ipc_bitwise_equal_on_one_gpu(packed):
    trainer = IPCTrainerProcess(update_info=INFO, device="cuda:0", timeout_s=120)
    receivers = [
        IPCReceiverProcess(update_info=INFO, device="cuda:0", worker_index=i, timeout_s=120)
        for i in range(2)
    ]
    try:
        init_info = trainer.call("init", packed=packed, bucket_size_bytes=1 << 18, timeout_s=60)[
            "init_info"
        ]
        for receiver in receivers:
            receiver.call("init", init_info=init_info)
        for seed in range(3):  # buffers and handles are reused across updates
            sent = trainer.send(receivers, seed=seed)["stats"]
            assert sent["direct_buckets"] == (0 if packed else 1)
            want = trainer.call("digests")["digests"]
            for receiver in receivers:
                assert receiver.call("digests")["digests"] == want
        assert trainer.call("segments")["segments"] == []  # CUDA memory needs no segment
    finally:
        for proc in [trainer, *receivers]:
            proc.close()


def test_unknown_gpu_uuid_lists_the_available_ones():
    session = ipc_trainer_init(packed=True, bucket_size_bytes=1 << 16)
    tensors = {s.name: torch.ones(s.shape, dtype=s.dtype, device="cuda:0") for s in SPECS}
    delivered = []
    try:
        args = IPCTrainerSendWeightsArgs(session, delivered.append)
        ipc_trainer_send_weights(tensors.items(), args)
        part = json.loads(json.dumps(delivered[1]))
        record = next(h for h in part["ipc_handles"] if "cuda" in h)
        record["cuda"]["device_uuid"] = "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"
        engine = IPCWeightTransferEngine()
        engine.init_transfer_engine(session.init_info)
        with pytest.raises(WeightValidationError) as raised:
            engine.receive_weights(part, lambda pairs: None)
        for uuid in cuda_device_uuids():
            assert uuid in str(raised.value)
        assert "GPU-ffffffff" in str(raised.value)
    finally:
        session.close()
