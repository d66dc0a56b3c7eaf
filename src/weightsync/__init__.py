"""weightsync: live weight updates and pause/resume for LLM inference engines in async RL.

The public API, re-exported from the modules that define it: the engine, the transfer backends
(worker engines, trainer functions, configs and infos), the trainer side
([`weightsync.trainer`][weightsync.trainer]) and the errors
([`weightsync.errors`][weightsync.errors]). Every other module is private (`_name`).
"""

import weightsync._quiet_numpy  # noqa: F401  (first: it must run before torch is imported)
from weightsync.config import WeightTransferConfig, parse_weight_transfer_config
from weightsync.engine import (
    AsyncEngine,
    ByteTokenizer,
    CompletionOutput,
    EngineConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    WeightVersionSpan,
)
from weightsync.errors import (
    EngineBusyError,
    EngineConfigError,
    EngineStateError,
    EngineTimeoutError,
    IncompleteWeightUpdateError,
    InvalidRequestError,
    NonFiniteWeightsError,
    ReplicaUnavailableError,
    TornWeightsError,
    WeightSyncError,
    WeightTransferError,
    WeightTransferTimeout,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.trainer import (
    BroadcastWeightSender,
    EngineClient,
    EngineProcess,
    IPCWeightSender,
    WeightSender,
    call_each,
    create_weight_sender,
    sync_weights,
)
from weightsync.transfer.base import (
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferUpdateInfo,
    WireParams,
    create_engine,
    register_engine,
)
from weightsync.transfer.buckets import flatten_module
from weightsync.transfer.checksums import weight_checksums
from weightsync.transfer.disk import (
    DiskWeightTransferEngine,
    DiskWeightTransferUpdateInfo,
    save_weight_dir,
)
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    IPCTrainerSession,
    IPCWeightTransferEngine,
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)
from weightsync.transfer.nccl import (
    GlooWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    TrainerGroup,
    trainer_init,
    trainer_send_weights,
)

__all__ = [
    "AsyncEngine",
    "BroadcastWeightSender",
    "ByteTokenizer",
    "CompletionOutput",
    "DiskWeightTransferEngine",
    "DiskWeightTransferUpdateInfo",
    "EngineBusyError",
    "EngineClient",
    "EngineConfig",
    "EngineConfigError",
    "EngineProcess",
    "EngineStateError",
    "EngineTimeoutError",
    "GlooWeightTransferEngine",
    "IPCTrainerSendWeightsArgs",
    "IPCTrainerSession",
    "IPCWeightSender",
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
    "IncompleteWeightUpdateError",
    "InvalidRequestError",
    "LLMEngine",
    "LlamaConfig",
    "LlamaForCausalLM",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "NonFiniteWeightsError",
    "ReplicaUnavailableError",
    "RequestOutput",
    "SamplingParams",
    "TensorSpec",
    "TornWeightsError",
    "TrainerGroup",
    "TransferStats",
    "WeightSender",
    "WeightSyncError",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightTransferUpdateInfo",
    "WeightUpdateStateError",
    "WeightValidationError",
    "WeightVersionSpan",
    "WireParams",
    "call_each",
    "create_engine",
    "create_weight_sender",
    "flatten_module",
    "ipc_trainer_init",
    "ipc_trainer_send_weights",
    "parse_weight_transfer_config",
    "register_engine",
    "save_weight_dir",
    "sync_weights",
    "trainer_init",
    "trainer_send_weights",
    "weight_checksums",
]

__version__ = "0.1.0"
