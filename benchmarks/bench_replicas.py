"""Data-parallel benchmark: one weight update into 1, 2 and 3 replicas, and where pauses land.

    python benchmarks/bench_replicas.py --json

- `update_seconds`: for each replica count N, a `weightsync serve --data-parallel-size N` with the
  `--model` preset; a trainer broadcasts over gloo to all N replicas at once (world size
  1 + N, from `/get_world_size`). One update is the whole transaction through the front, timed by
  the trainer from `/start_weight_update` to the answer of `/finish_weight_update` (every replica
  checked, then committed), with `/update_weights` received while the trainer broadcasts.
  p50 (the median) and p99 over `--repeats` rounds after a warm-up round; the three servers run
  side by side and take turns in each round, so load from elsewhere falls on each alike.
- `update_time_ratio_3_vs_1` = median(3 replicas) / median(1 replica) (target <= 2.0: one
  broadcast feeds every replica; the replicas share the machine's cores).
- `keep_pause_landing_steps`: with `--streams` streams spread over the replicas, `--pauses`
  `/pause?mode=keep` calls through the front; for each replica, its engine steps between handling
  the pause and the pause having landed (`/engine_stats` -> `replicas[i].last_pause`), p50 and
  p99 over every replica of every pause (target p99 <= 1: the step in flight, nothing else).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    TrainerGroup,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)

SRC = Path(__file__).resolve().parents[1] / "src"
TIMEOUT_S = 300.0


def start_front(model: str, replicas: int) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "weightsync.serve.cli", "serve", model, "--port", "0",
               "--data-parallel-size", str(replicas), "--weight-transfer-config.backend", "gloo",
               "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    front = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert front.stderr is not None
    for line in front.stderr:
        if found := re.search(r"listening on (\S+)", line):
            threading.Thread(target=front.stderr.read, daemon=True).start()  # keep it drained
            return front, found.group(1)
    raise SystemExit(f"weightsync serve --data-parallel-size {replicas} did not start")


def post(url: str, path: str, **kwargs: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}{path}", timeout=TIMEOUT_S, **kwargs)
    response.raise_for_status()
    return dict(response.json())


def connect(url: str) -> TrainerGroup:
    """The trainer's gloo group with every replica behind `url` (world size 1 + replicas)."""
    world_size = httpx.get(f"{url}/get_world_size", timeout=TIMEOUT_S).json()["world_size"]
    group = trainer_init(world_size=1 + world_size, backend="gloo", timeout_s=TIMEOUT_S)
    joining = threading.Thread(target=post, args=(url, "/init_weight_transfer_engine"),
                               kwargs={"json": {"init_info": group.init_info}})  # fmt: skip
    joining.start()
    group.connect()
    joining.join(TIMEOUT_S)
    return group


def update_seconds(
    url: str, group: TrainerGroup, pairs: list[tuple[str, Any]], version: int
) -> float:
    """Times one whole update through the front."""
    update_info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
    start = time.perf_counter()
    post(url, "/start_weight_update")
    receiving = threading.Thread(target=post, args=(url, "/update_weights"),
                                 kwargs={"json": {"update_info": update_info}})  # fmt: skip
    receiving.start()
    trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, update_info))
    receiving.join(TIMEOUT_S)
    post(url, "/finish_weight_update", json={"weight_version": version})
    return time.perf_counter() - start


def pause_landings(url: str, streams: int, pauses: int) -> list[int]:
    """Per-replica steps between handling a keep pause and its landing, over `pauses` pauses."""
    body = {"max_tokens": 400, "ignore_eos": True, "temperature": 1.0}
    stop = threading.Event()

    def stream(index: int) -> None:
        while not stop.is_set():  # a new request when one ends at the model's length
            payload = {**body, "prompt": f"s{index}", "seed": index}
            with httpx.stream("POST", f"{url}/v1/completions", json={**payload, "stream": True},
                              timeout=TIMEOUT_S) as response:  # fmt: skip
                for _ in response.iter_lines():
                    pass

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    landings: list[int] = []
    for _ in range(pauses):
        steps = [r["num_steps"] for r in httpx.get(f"{url}/engine_stats").json()["replicas"]]
        while any(r["num_steps"] < s + 2 for r, s in zip(
            httpx.get(f"{url}/engine_stats").json()["replicas"], steps, strict=True
        )):  # fmt: skip
            time.sleep(0.005)  # every replica generates between pauses
        post(url, "/pause", params={"mode": "keep"})
        for replica in httpx.get(f"{url}/engine_stats").json()["replicas"]:
            last = replica["last_pause"]
            landings.append(last["landed_at_step"] - last["requested_at_step"])
        post(url, "/resume")
    stop.set()
    post(url, "/abort_requests", json={})
    for thread in threads:
        thread.join(TIMEOUT_S)
    return landings


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1,
            round(0.99 * (len(ordered) - 1)))]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="preset of the replicas and trainer")
    parser.add_argument("--repeats", type=int, default=7, help="timed updates per replica count")
    parser.add_argument("--replicas", type=int, default=3, help="largest replica count")
    parser.add_argument("--streams", type=int, default=6, help="streams during the pauses")
    parser.add_argument("--pauses", type=int, default=30, help="keep pauses measured")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()

    counts = [str(count) for count in range(1, args.replicas + 1)]
    fronts = {count: start_front(args.model, int(count)) for count in counts}
    seconds: dict[str, list[float]] = {count: [] for count in counts}
    try:
        groups = {count: connect(url) for count, (_, url) in fronts.items()}
        for repeat in range(args.repeats + 1):  # the replica counts take turns in each round
            pairs = list(LlamaForCausalLM.from_preset(args.model, seed=repeat).named_weights())
            for count, (_, url) in fronts.items():
                took = update_seconds(url, groups[count], pairs, repeat)
                if repeat:  # round 0 is the warm-up
                    seconds[count].append(took)
        for group in groups.values():
            group.close()
        landings = pause_landings(fronts[counts[-1]][1], args.streams, args.pauses)
    finally:
        for front, _ in fronts.values():
            front.terminate()
            front.wait(TIMEOUT_S)
    if not args.json:
        for count, values in seconds.items():
            print(f"{count} replica(s): median update {statistics.median(values):.3f} s")
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "benchmark": "replicas", "model": args.model, "repeats": args.repeats,
        "update_seconds": {f"{k} replica(s)": summary(v) for k, v in seconds.items()},
        "update_median_seconds_by_replicas": medians,
        "update_time_ratio_3_vs_1": medians[str(args.replicas)] / medians["1"],
        "keep_pause_landing_steps": {f"{args.replicas} replicas": summary(landings)},
        "keep_pause_p99_steps": summary(landings)["p99"],
        "keep_pause_max_steps": max(landings),
        "keep_pause_samples": len(landings),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "machine": describe_machine(),
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
