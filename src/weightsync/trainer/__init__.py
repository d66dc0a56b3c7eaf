"""Trainer-side orchestration: clients of inference engines, weight senders, the sync flow.

The trainer talks to its engines through [`EngineClient`][weightsync.trainer.senders.EngineClient]s:
an [`LLMEngine`][weightsync.engine.llm_engine.LLMEngine] in its own process, an
[`EngineProcess`][weightsync.trainer.engine_process.EngineProcess] that generates in a process of
its own while the trainer trains, or a `weightsync serve` server through an
[`HTTPEngineClient`][weightsync.trainer.http_client.HTTPEngineClient]. A
[`WeightSender`][weightsync.trainer.senders.WeightSender] (broadcast or IPC, from
[`create_weight_sender`][weightsync.trainer.senders.create_weight_sender]) moves the weights,
and [`sync_weights`][weightsync.trainer.senders.sync_weights] runs one update: pause every engine,
send, resume.
"""

from weightsync.trainer.engine_process import EngineProcess
from weightsync.trainer.http_client import HTTPEngineClient
from weightsync.trainer.senders import (
    BroadcastWeightSender,
    EngineClient,
    IPCWeightSender,
    WeightSender,
    call_each,
    create_weight_sender,
    sync_weights,
)

__all__ = [
    "BroadcastWeightSender",
    "EngineClient",
    "EngineProcess",
    "HTTPEngineClient",
    "IPCWeightSender",
    "WeightSender",
    "call_each",
    "create_weight_sender",
    "sync_weights",
]
