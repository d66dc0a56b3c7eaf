"""Prepacked linears in the engine: decode speed and weight-update time, packed against plain.

    python benchmarks/bench_prepack.py --json
    python benchmarks/bench_prepack.py --rounds 7 --streams 8 64 --json

Two engines in this process hold the same float32 `small` preset (hidden 512, 8 layers), one
with `EngineConfig(prepack_linears=True)` (the default) and one without. Each round runs, for
each engine in an order that alternates from round to round (so a busy moment of the machine
falls on both):

- `decode`: `--streams` greedy requests at once (32-token prompts of fresh random token ids, 64
  tokens each, `ignore_eos`), stepped in process until done: output tokens per second, and the
  median time of a decode step (steps after the last prefill);
- `update_gloo`, `update_ipc`: a whole update of every weight from an in-process trainer
  (`BroadcastWeightSender` over gloo, `IPCWeightSender` through shared memory), timed around
  `send` (start, transfer, finish). The packed engine's finish drops the landed linears' copies
  and a thread rebuilds them: `rebuild_after_update_{gloo,ipc}_s` is the time from `send`'s
  return until the new copies are in (the steps meanwhile multiply by the plain weights). The
  next figure is timed only once the rebuild is done, so it does not share the CPU with it;
- `repack_s`: the packed engine's `model.repack_linears()` alone, on the calling thread.

Figures are medians over `--rounds` rounds; each `*_ratio` is the median of the per-round ratios
packed / plain (for times: plain / packed, so above 1 means the packed engine is faster). The
greedy tokens of both engines on the same requests are compared (`greedy_identical`). The load
average is recorded per round: the machine may be shared, so read the ratios. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams
from weightsync.trainer.senders import BroadcastWeightSender, IPCWeightSender

PROMPT_TOKENS, MAX_TOKENS = 32, 64


def _engine(packed: bool) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=2048, prepack_linears=packed)
    return LLMEngine(LlamaForCausalLM.from_preset("small", seed=0), engine_config=config)


def _decode(engine: LLMEngine, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
    """Tokens per second, median decode-step seconds and the greedy tokens of `prompts`."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    step_times = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - step_start)
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    elapsed = time.perf_counter() - start
    decode_steps = step_times[-(MAX_TOKENS - 2) :]  # the prefill steps come first
    return (
        len(prompts) * MAX_TOKENS / elapsed,
        statistics.median(decode_steps),
        [tokens[i] for i in ids],
    )


def _update(
    engine: LLMEngine, trainer: LlamaForCausalLM, backend: str, version: int
) -> tuple[float, float]:
    """Seconds of one whole update of `engine` from `trainer` over `backend`, then of its rebuild.

    The rebuild: from the update's return until the new packed copies are in (0 when plain).
    """
    sender = (
        BroadcastWeightSender([engine], backend="gloo", timeout_s=120)
        if backend == "gloo"
        else IPCWeightSender([engine])
    )
    with sender:
        start = time.perf_counter()
        sender.send(trainer.named_weights(), weight_version=version)
        sent = time.perf_counter()
        assert engine.model.wait_for_repack(timeout_s=120), "the rebuild did not end in 120 s"
        rebuilt = time.perf_counter()
    return sent - start, rebuilt - sent


def main() -> None:
    """Runs the rounds and prints the figures (one JSON object with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {"packed": _engine(True), "plain": _engine(False)}
    assert engines["packed"].model.linears_packed, "oneDNN's prepacked linear is unavailable"
    trainer = LlamaForCausalLM.from_preset("small", seed=1)
    rng = random.Random(0)
    vocab = trainer.config.vocab_size
    samples: dict[str, dict[str, list[float]]] = {}
    identical = total = 0
    loads = []

    def record(figure: str, label: str, value: float) -> None:
        samples.setdefault(figure, {}).setdefault(label, []).append(value)

    for round_index in range(args.rounds + 1):  # round 0 warms up and is not counted
        order = ["packed", "plain"] if round_index % 2 else ["plain", "packed"]
        loads.append(round(os.getloadavg()[0], 2))
        for streams in args.streams:
            prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(streams)]
            tokens = {}
            for label in order:
                rate, step_s, tokens[label] = _decode(engines[label], prompts)
                if round_index:
                    record(f"decode_{streams}_tokens_per_s", label, rate)
                    record(f"decode_{streams}_step_s", label, step_s)
            if round_index:
                total += len(prompts)
                identical += sum(
                    a == b for a, b in zip(tokens["packed"], tokens["plain"], strict=True)
                )
        for backend in ("gloo", "ipc"):
            for label in order:
                seconds, rebuild_s = _update(engines[label], trainer, backend, round_index)
                if round_index:
                    record(f"update_{backend}_s", label, seconds)
                    if label == "packed":
                        record(f"rebuild_after_update_{backend}_s", label, rebuild_s)
        if round_index:
            model = engines["packed"].model
            start = time.perf_counter()
            model.repack_linears()
            record("repack_s", "packed", time.perf_counter() - start)

    # Flat keys, packed and plain side by side (`decode_8_packed_tokens_per_s`), as the docs'
    # plots read them; each ratio beside them.
    figures: dict[str, float] = {}
    for figure, by_label in samples.items():
        unit = "tokens_per_s" if "tokens" in figure else "s"
        stem = figure.removesuffix(f"_{unit}")
        for label, values in by_label.items():
            figures[f"{stem}_{label}_{unit}"] = round(statistics.median(values), 4)
        if "plain" in by_label:
            pairs = zip(by_label["packed"], by_label["plain"], strict=True)
            higher_is_better = unit == "tokens_per_s"
            figures[f"{stem}_ratio"] = round(
                statistics.median(p / q if higher_is_better else q / p for p, q in pairs), 3
            )
    packed_bytes = sum(
        module.weight.numel() * module.weight.element_size()
        for module in engines["packed"].model.modules()
        if getattr(module, "packed", None) is not None
    )
    report = {
        "benchmark": "prepack",
        "command": f"python benchmarks/bench_prepack.py --rounds {args.rounds} --streams "
        f"{' '.join(map(str, args.streams))} --threads {args.threads} --json",
        "machine": describe_machine(),
        "model": "small preset, float32 (hidden 512, 8 layers, vocabulary 259)",
        "threads": args.threads,
        "rounds": args.rounds,
        "load_average_per_round": loads,
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "packed_copy_bytes": packed_bytes,
        "greedy_identical": f"{identical} of {total}",
        **figures,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
