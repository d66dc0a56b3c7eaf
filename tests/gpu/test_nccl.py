"""The nccl backend: a trainer process on cuda:0 broadcasting to a receiver process on cuda:1."""

import pytest
import torch

from process_rigs import ReceiverProcess, TrainerProcess
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

SPECS = [
    TensorSpec("embed.weight", torch.bfloat16, (1024, 256)),
    TensorSpec("norm.weight", torch.float32, (256,)),
    TensorSpec("scale", torch.float8_e4m3fn, (77,)),
    TensorSpec("step", torch.int64, ()),
    TensorSpec("empty", torch.float16, (0, 8)),
    TensorSpec("head.weight", torch.bfloat16, (1024, 256)),
]
INFO = WeightTransferUpdateInfo.from_specs(SPECS).to_dict()


@pytest.mark.parametrize(("packed", "flat"), [(True, False), (False, False), (True, True)])
def test_nccl_bitwise_equal_across_devices(packed, flat):
    trainer = TrainerProcess(update_info=INFO, flat=flat, device="cuda:0", timeout_s=120)
    receiver = ReceiverProcess(
        backend="nccl", update_info=INFO, flat=flat, device="cuda:1", timeout_s=120
    )
    try:
        init_info = trainer.call(
            "init",
            world_size=2,
            backend="nccl",
            packed=packed,
            bucket_size_bytes=1 << 18,
            timeout_s=60,
        )["init_info"]
        receiver.start("init", init_info=init_info)
        trainer.call("connect")
        receiver.reply()
        for seed in range(3):
            receiver.start("update", update_info=INFO)
            sent = trainer.call("send", seed=seed)["stats"]
            got = receiver.reply()["stats"]
            assert got["num_bytes"] == sent["num_bytes"]
            assert receiver.call("digests")["digests"] == trainer.call("digests")["digests"]
        if flat:
            assert got["direct_buckets"] == got["num_buckets"]
    finally:
        trainer.close()
        receiver.close()
