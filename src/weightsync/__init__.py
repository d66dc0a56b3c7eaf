"""weightsync: live weight updates and pause/resume for LLM inference engines in async RL.

The public API, re-exported from the modules that define it.
"""

from weightsync.config import WeightTransferConfig, parse_weight_transfer_config
from weightsync.transfer.base import (
    TensorSpec,
    TransferStats,
    WeightSyncError,
    WeightTransferEngine,
    WeightTransferError,
    WeightTransferTimeout,
    WeightTransferUpdateInfo,
    WeightValidationError,
)
from weightsync.transfer.flat import flatten_module
from weightsync.transfer.nccl import (
    GlooWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    TrainerGroup,
    trainer_init,
    trainer_send_weights,
)
from weightsync.transfer.registry import create_engine, register_engine

__all__ = [
    "GlooWeightTransferEngine",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "TensorSpec",
    "TrainerGroup",
    "TransferStats",
    "WeightSyncError",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightTransferUpdateInfo",
    "WeightValidationError",
    "create_engine",
    "flatten_module",
    "parse_weight_transfer_config",
    "register_engine",
    "trainer_init",
    "trainer_send_weights",
]

__version__ = "0.1.0"
