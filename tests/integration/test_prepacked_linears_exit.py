"""A process whose interpreter exits while the packed copies of its linears are rebuilt exits
cleanly: the rebuild thread is never torn down inside one of torch's calls.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

PACKS = torch.backends.mkldnn.is_available()

# A process whose interpreter exits while a rebuild packs: the rebuild's first copy signals the
# main thread, which returns at once, so exit begins while the rest are built (small: 33 copies).
EXIT_DURING_REBUILD = """
import threading
import torch
from weightsync.engine import _packed_linear
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.trainer.senders import IPCWeightSender

pack, packing = _packed_linear.pack_weight, threading.Event()
def signalling_pack(weight):
    if threading.current_thread() is not threading.main_thread():
        packing.set()
    return pack(weight)
_packed_linear.pack_weight = signalling_pack
engine = LLMEngine(LlamaForCausalLM.from_preset("small", seed=0, dtype=torch.float32))
with IPCWeightSender([engine]) as sender:
    sender.send(LlamaForCausalLM.from_preset("small", seed=1).named_weights(), weight_version=1)
assert packing.wait(timeout=60), "no rebuild began"
print("exiting while a rebuild packs", flush=True)
"""


@pytest.mark.parametrize("run", range(3))
def test_the_process_exits_cleanly_while_a_rebuild_packs(run):
    # Torch torn down under a thread still in one of its calls ended in std::terminate.
    if not PACKS:
        pytest.skip("this torch build has no oneDNN: the linears read plain weights only")
    done = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_REBUILD], capture_output=True, text=True, timeout=120
    )
    assert "exiting while a rebuild packs" in done.stdout, done.stderr
    assert done.returncode == 0, done.stderr
    assert "terminate" not in done.stderr
