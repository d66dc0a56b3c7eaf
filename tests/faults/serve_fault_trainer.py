"""A trainer's end of a gloo broadcast, in a process of its own, that dies mid-transfer on cue.

Usage: `python serve_fault_trainer.py KILL_AT_TENSOR TIMEOUT_S`. It speaks JSON lines: it prints
`{"init_info": ...}`, waits for the engine to join, prints `{"update_info": ...}`, then waits for
a line on stdin and sends the update; when the sender takes tensor KILL_AT_TENSOR (buckets
before it are on the wire by then) it kills itself with SIGKILL, as an OOM killer would.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)

BUCKET_BYTES = 32 << 10  # the debug model travels in a dozen buckets


def say(**message: object) -> None:
    print(json.dumps(message), flush=True)


def main() -> None:
    kill_at, timeout_s = int(sys.argv[1]), float(sys.argv[2])
    group = trainer_init(
        world_size=2, backend="gloo", timeout_s=timeout_s, bucket_size_bytes=BUCKET_BYTES
    )
    say(init_info=group.init_info)
    group.connect()
    pairs = list(LlamaForCausalLM.from_preset("debug", seed=7).named_weights())
    update_info = WeightTransferUpdateInfo.from_named_tensors(pairs, weight_version="v-dead")
    say(update_info=update_info.to_dict())
    sys.stdin.readline()
    taken = 0

    def take(pair: tuple[str, object]) -> object:
        nonlocal taken
        if taken == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        taken += 1
        return pair[1]

    trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, update_info, take))
    say(sent=True)  # not reached


if __name__ == "__main__":
    main()
