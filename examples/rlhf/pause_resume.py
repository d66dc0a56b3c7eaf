"""The pause modes side by side: the same requests in flight, paused four ways for a weight update.

What it shows: what `abort`, `wait` and `keep` (with and without `clear_cache`) do to requests
that are running when the trainer pauses the engine, step by step. Each scenario starts a fresh
engine with the same weights and the same requests, pauses it when the running requests have
`--pause-at` tokens, pushes new weights (version 1) while it is paused, and resumes. For every
request the script prints which tokens it got, at which engine steps, from which weights, and
how it ended.

Flow, per scenario:

1. Three greedy requests start together: `A` and `B` want 12 tokens, `C` only 3 (it finishes
   before the pause).
2. After `--pause-at` steps, pause with the scenario's mode. The engine is stepped by hand here
   so every token's step shows; `pause_generation` does the same and returns once paused.
3. While paused, request `D` arrives: it is queued, not rejected.
4. Push the trainer's new weights (version 1) through an
   [`IPCWeightSender`][weightsync.trainer.senders.IPCWeightSender], then resume and run to the
   end. ([`sync_weights`][weightsync.trainer.senders.sync_weights] does pause, send and resume in
   one call.)
5. Check what each mode promises:
    - `abort`: `A` and `B` end at the pause (`finish_reason="abort"`) with their partial output;
    - `wait`: `A` and `B` run to completion on the old weights, then the update lands;
    - `keep`: `A` and `B` freeze, then continue on the new weights. With `clear_cache=True` their
      KV is recomputed first, so their continuation is exactly what the new weights produce
      from scratch; with `clear_cache=False` it attends to KV of the old weights and differs;
    - every mode: `D`, which arrived while paused, runs entirely on the new weights.

Run it: `python examples/rlhf/pause_resume.py` (about 3 seconds on a CPU).

Hardware: one process. The engine computes on the GPU when there is one (the CPU otherwise); the
"trainer" (a second model, on the CPU) shares the process and hands it weights through shared
memory. The pause machinery is the same on any device. Both compute in float64, so that comparing
greedy outputs computed two ways (or on two devices) cannot trip over rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from weightsync import (
    ByteTokenizer,
    EngineConfig,
    LlamaForCausalLM,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)
from weightsync.trainer import IPCWeightSender

DTYPE = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the engine computes
SCENARIOS = [("abort", True), ("wait", True), ("keep", True), ("keep", False)]
REQUESTS = {"A": ("The weights", 12), "B": ("Pause here", 12), "C": ("Short", 3)}


class Timeline:
    """Each request's tokens, with the engine step that produced them."""

    def __init__(self) -> None:
        self.steps: dict[str, list[int]] = {}
        self.final: dict[str, RequestOutput] = {}
        self.paused_at = 0  # the engine step after which the pause landed
        self.resumed_at = 0  # the engine step after which it resumed

    def record(self, outputs: list[RequestOutput], step: int) -> None:
        """Notes the new tokens of `outputs` as produced at engine step `step`."""
        for output in outputs:
            seen = self.steps.setdefault(output.request_id, [])
            seen += [step] * (len(output.outputs[0].token_ids) - len(seen))
            if output.finished:
                self.final[output.request_id] = output

    def describe(self, request_id: str) -> str:
        """One line: the request's runs of tokens by weight version, with their steps."""
        out = self.final[request_id].outputs[0]
        steps = self.steps[request_id]
        spans = ", ".join(
            f"v{span.weight_version} x{span.end - span.start} "
            f"(steps {steps[span.start]}-{steps[span.end - 1]})"
            for span in out.weight_version_spans
        )
        return f"{spans or 'no tokens'} -> {out.finish_reason:6} {out.text!r}"


def step(engine: LLMEngine, timeline: Timeline) -> None:
    """Runs one engine step and records what it produced."""
    timeline.record(engine.step(), engine.num_steps)


def fresh_greedy(model: LlamaForCausalLM, token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from `model` recomputing the whole sequence each time: no KV cache at all."""
    ids = list(token_ids)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids.append(int(model.compute_logits(model(torch.tensor(ids))[-1:]).argmax()))
    return ids[len(token_ids) :]


def run_scenario(
    mode: str, clear_cache: bool, pause_at: int, new_policy: LlamaForCausalLM
) -> Timeline:
    """Runs the requests through one pause-update-resume; returns what happened."""
    config = EngineConfig(num_kv_blocks=64, device=DEVICE)
    engine = LLMEngine("debug", seed=0, dtype=DTYPE, engine_config=config)
    timeline = Timeline()
    for request_id, (prompt, max_tokens) in REQUESTS.items():
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(request_id, prompt, greedy)
    for _ in range(pause_at):
        step(engine, timeline)

    engine.start_pause(mode=mode, clear_cache=clear_cache)  # type: ignore[arg-type]
    while not engine.is_paused():  # `wait` drains first: its running requests run to the end
        step(engine, timeline)
    step(engine, timeline)  # paused: runs nothing, delivers what the pause ended
    timeline.paused_at = engine.num_steps
    engine.add_request("D", "Arrived while paused", SamplingParams(temperature=0, max_tokens=4))

    with IPCWeightSender([engine]) as sender:
        sender.send(new_policy.named_weights(), weight_version=1)
    engine.resume_generation()
    timeline.resumed_at = engine.num_steps
    while engine.has_unfinished_requests():
        step(engine, timeline)
    engine.shutdown()
    return timeline


def check(
    mode: str, clear_cache: bool, timeline: Timeline, pause_at: int, new_policy: LlamaForCausalLM
) -> list[str]:
    """What the mode promises, as a list of broken promises (empty when all hold)."""
    problems = []
    outputs = {rid: final.outputs[0] for rid, final in timeline.final.items()}
    for rid in ("A", "B"):
        out, wanted = outputs[rid], REQUESTS[rid][1]
        if mode == "abort":
            expected = ([0] * pause_at, "abort")
        elif mode == "wait":
            expected = ([0] * wanted, "length")
        else:
            expected = ([0] * pause_at + [1] * (wanted - pause_at), "length")
        if (out.weight_versions, out.finish_reason) != expected:
            problems.append(f"{rid}: versions {out.weight_versions}, {out.finish_reason}")
    if outputs["C"].weight_versions != [0] * 3 or set(outputs["D"].weight_versions) != {1}:
        problems.append(f"C or D took the wrong weights: {outputs['C']}, {outputs['D']}")
    if mode == "keep":
        # With clear_cache the continuation is exactly the new weights' own; without, the old KV
        # changes it. Greedy in float64 makes "exactly" a token-for-token comparison.
        exact = [
            outputs[rid].token_ids[pause_at:]
            == fresh_greedy(
                new_policy,
                timeline.final[rid].prompt_token_ids + outputs[rid].token_ids[:pause_at],
                REQUESTS[rid][1] - pause_at,
            )
            for rid in ("A", "B")
        ]
        print(f"    continuation of A, B equals a fresh decode with the new weights: {exact}")
        if clear_cache and not all(exact):
            problems.append("clear_cache=True, yet a continuation differs from the new weights'")
        if not clear_cache and all(exact):
            problems.append("clear_cache=False, yet the stale KV changed no continuation")
    return problems


def scenario_log(mode: str, clear_cache: bool, timeline: Timeline) -> dict[str, object]:
    """One scenario as JSON: each request's tokens with their step and weight version."""
    tokenizer = ByteTokenizer()
    requests = {}
    for request_id, final in sorted(timeline.final.items()):
        out = final.outputs[0]
        requests[request_id] = {
            "tokens": [tokenizer.decode([t]) for t in out.token_ids],
            "steps": timeline.steps.get(request_id, []),
            "weight_versions": out.weight_versions,
            "finish_reason": out.finish_reason,
        }
    return {
        "mode": mode,
        "clear_cache": clear_cache,
        "paused_at_step": timeline.paused_at,
        "resumed_at_step": timeline.resumed_at,
        "requests": requests,
    }


def main() -> int:
    """Runs the four scenarios; returns the exit code (non-zero when a mode broke a promise)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pause-at", type=int, default=4, help="tokens of A and B at the pause")
    parser.add_argument("--log", type=Path, help="write every scenario's tokens as JSON here")
    args = parser.parse_args()
    if not REQUESTS["C"][1] < args.pause_at < REQUESTS["A"][1]:
        parser.error(
            f"--pause-at must be between {REQUESTS['C'][1] + 1} and {REQUESTS['A'][1] - 1}"
        )

    new_policy = LlamaForCausalLM.from_preset("debug", seed=1, dtype=DTYPE)  # the trainer's next
    problems = []
    logs = []
    for mode, clear_cache in SCENARIOS:
        print(f"mode={mode!r}, clear_cache={clear_cache}: paused after step {args.pause_at}")
        timeline = run_scenario(mode, clear_cache, args.pause_at, new_policy)
        logs.append(scenario_log(mode, clear_cache, timeline))
        for request_id in ("A", "B", "C", "D"):
            print(f"  {request_id}: {timeline.describe(request_id)}")
        problems += [
            f"{mode}/{clear_cache}: {p}"
            for p in check(mode, clear_cache, timeline, args.pause_at, new_policy)
        ]
    if args.log is not None:
        log = {"example": "pause_resume", "pause_at": args.pause_at, "scenarios": logs}
        args.log.write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print("ok: every pause mode kept its promises")
    return 0


if __name__ == "__main__":
    sys.exit(main())
