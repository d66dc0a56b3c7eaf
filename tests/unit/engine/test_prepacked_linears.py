"""Prepacked linears: a float32 engine on a CPU multiplies by packed copies of its weights, and
no step after a weight update's commit multiplies by a copy of older weights.

The packed copies are a second copy of the weights: a token generated after an update must come
from the new weights (equal to a fresh engine built with them), after an update through the
real transfer paths (gloo, IPC) as after one through the engine's own calls; an update that is
refused or aborted leaves the packed copies as they were. The commit does not wait for the new
copies: the updated linears read their plain weights until a thread swaps the copies in, and a
rebuild that a later update overtook (begun, committed or aborted) is never installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from engine_helpers import PROMPTS, greedy, small_config

from model_dirs import FAMILIES
from weightsync.engine import _packed_linear
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.errors import EngineStateError, WeightTransferError, WeightValidationError
from weightsync.serve.cli import _engine_config, _parse_serve_args
from weightsync.trainer.engine_process import _serve_args
from weightsync.trainer.senders import BroadcastWeightSender, IPCWeightSender

# A torch build without oneDNN serves from the plain weights: the token checks hold all the same.
PACKS = torch.backends.mkldnn.is_available()

MAX_TOKENS = 12


def float32_model(seed: int) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_preset("debug", seed=seed, dtype=torch.float32)


def engine_with(seed: int, *, worker_index: int = 0, **config: object) -> LLMEngine:
    return LLMEngine(
        float32_model(seed), engine_config=small_config(**config), worker_index=worker_index
    )


def greedy_tokens(engine: LLMEngine) -> list[list[int]]:
    outputs = engine.generate(PROMPTS[:6], greedy(MAX_TOKENS))
    return [out.outputs[0].token_ids for out in outputs]


def packed_copies(engine: LLMEngine) -> dict[str, torch.Tensor | None]:
    """Each linear's packed copy, by module name (the objects themselves)."""
    return {
        name: module.packed
        for name, module in engine.model.named_modules()
        if hasattr(module, "packed")
    }


@pytest.fixture(scope="module")
def tokens_of_seed() -> dict[int, list[list[int]]]:
    """Greedy tokens of fresh engines built with the weights of seeds 0 and 1."""
    return {seed: greedy_tokens(engine_with(seed)) for seed in (0, 1)}


def test_a_float32_engine_on_a_cpu_multiplies_by_packed_weights():
    engine = engine_with(0)
    copies = packed_copies(engine)
    assert len(copies) == 2 * 4 + 1  # q/k/v and o, gate/up and down per layer; the LM head
    assert engine.model.linears_packed == PACKS
    assert all((copy is not None and copy.is_mkldnn) == PACKS for copy in copies.values())
    plain = engine_with(0, prepack_linears=False)
    assert not plain.model.linears_packed
    assert all(copy is None for copy in packed_copies(plain).values())
    # Where packing is not measured to win (float64 here), the plain weights serve.
    wide = LLMEngine(LlamaForCausalLM.from_preset("debug", dtype=torch.float64))
    assert not wide.model.linears_packed


def test_the_command_line_turns_packing_off_and_a_child_server_gets_the_flag():
    args, _ = _parse_serve_args(["serve", "debug", "--no-prepack-linears"])
    assert _engine_config(args).prepack_linears is False
    args, _ = _parse_serve_args(["serve", "debug"])
    assert _engine_config(args).prepack_linears is True
    assert "--no-prepack-linears" in _serve_args(EngineConfig(prepack_linears=False))
    assert "--no-prepack-linears" not in _serve_args(EngineConfig())


def test_packed_and_plain_weights_give_the_same_logits_and_tokens(tokens_of_seed):
    packed = engine_with(0)
    plain = engine_with(0, prepack_linears=False)
    ids = torch.tensor(packed.tokenizer.encode(PROMPTS[5]))
    with torch.no_grad():
        logits = packed.model.compute_logits(packed.model(ids))
        expected = plain.model.compute_logits(plain.model(ids))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert greedy_tokens(plain) == tokens_of_seed[0]


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_tokens_after_an_update_come_from_the_new_weights(backend, tokens_of_seed):
    assert tokens_of_seed[0] != tokens_of_seed[1]  # else the test could not tell them apart
    engine = engine_with(0)
    assert greedy_tokens(engine) == tokens_of_seed[0]
    before = packed_copies(engine)
    trainer = float32_model(seed=1)
    sender = (
        BroadcastWeightSender([engine], backend="gloo", timeout_s=60)
        if backend == "gloo"
        else IPCWeightSender([engine])
    )
    with sender:
        sender.send(trainer.named_weights(), weight_version="step-1")
    assert engine.weight_version == "step-1"
    assert all(
        packed_copies(engine)[name] is not copy or not PACKS for name, copy in before.items()
    )
    assert greedy_tokens(engine) == tokens_of_seed[1]


def test_an_update_of_a_tied_embedding_repacks_the_lm_head():
    def tied(seed: int) -> LLMEngine:
        model = LlamaForCausalLM.from_preset(
            "debug", seed=seed, dtype=torch.float32, tie_word_embeddings=True
        )
        return LLMEngine(model, engine_config=small_config())

    engine, fresh = tied(0), tied(1)
    new_embedding = dict(fresh.model.named_weights())["model.embed_tokens.weight"]
    with IPCWeightSender([engine]) as sender:
        sender.send([("model.embed_tokens.weight", new_embedding)], weight_version=1)
    with torch.no_grad():
        hidden = torch.randn(3, engine.model.config.hidden_size)
        logits = engine.model.compute_logits(hidden)
    torch.testing.assert_close(logits, hidden @ new_embedding.T, rtol=0, atol=1e-5)


def test_a_refused_update_leaves_the_packed_copies_as_they_were(tokens_of_seed):
    engine = engine_with(0)
    before = packed_copies(engine)
    trainer = float32_model(seed=1)
    wrong = [(n, t[..., :1] if n == "lm_head.weight" else t) for n, t in trainer.named_weights()]
    with IPCWeightSender([engine]) as sender, pytest.raises(WeightValidationError):
        sender.send(wrong, weight_version=1)
    assert packed_copies(engine) == before  # the very same objects: nothing was repacked
    assert engine.weight_version == 0
    assert greedy_tokens(engine) == tokens_of_seed[0]


class FailsAtFinish:
    """An engine whose finish never comes: the trainer died after the bytes moved, say."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def finish_weight_update(self, weight_version: object = None) -> bool:
        raise WeightTransferError("the trainer died before finish_weight_update (simulated)")


def test_an_aborted_update_restores_the_weights_that_the_packed_copies_still_hold(
    tokens_of_seed,
):
    engine = engine_with(0, weight_update_staging=True)
    before = packed_copies(engine)
    trainer = float32_model(seed=1)
    with (
        IPCWeightSender([FailsAtFinish(engine)]) as sender,
        pytest.raises(WeightTransferError, match="simulated"),
    ):
        sender.send(trainer.named_weights(), weight_version=1)  # lands, then aborts
    assert engine.weight_update is None and engine.weight_version == 0
    assert packed_copies(engine) == before  # the very same objects: nothing was repacked
    assert greedy_tokens(engine) == tokens_of_seed[0]
    with IPCWeightSender([engine]) as sender:  # the next update lands whole
        sender.send(trainer.named_weights(), weight_version=2)
    assert greedy_tokens(engine) == tokens_of_seed[1]


def test_a_reset_and_a_level_2_sleep_leave_no_stale_packed_copy(tokens_of_seed):
    engine = engine_with(0)
    engine.reset_weights()  # every weight zero: so is every linear's output
    for module in engine.model.modules():
        if hasattr(module, "packed"):
            assert not module(torch.randn(3, module.in_features)).any()
    assert all(tokens == [0] * MAX_TOKENS for tokens in greedy_tokens(engine))
    engine.sleep(level=2)
    assert all(copy is None for copy in packed_copies(engine).values())  # freed with the weights
    engine.wake_up()
    trainer = float32_model(seed=1)
    with IPCWeightSender([engine]) as sender:
        sender.send(trainer.named_weights(), weight_version=1)
    engine.resume_generation()
    assert engine.model.wait_for_repack(timeout_s=60)
    assert all((copy is not None) == PACKS for copy in packed_copies(engine).values())
    assert greedy_tokens(engine) == tokens_of_seed[1]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_float32_greedy_tokens_equal_transformers(family_dir, name):
    transformers = pytest.importorskip("transformers")
    path = family_dir(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(str(path), dtype=torch.float32, engine_config=small_config())
    assert engine.model.linears_packed == PACKS
    prompts = ["The quick brown fox", "def main():\n", "the answer is"]
    outputs = engine.generate(prompts, greedy(16))
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=16, min_new_tokens=16)  # fmt: skip
        assert out.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist(), prompt


class HeldRebuild:
    """Holds the first copy built off the test's thread (a rebuild's) until `release()`.

    `held` is set once that rebuild waits; `copies` are the copies it went on to build.
    """

    def __init__(self, pack: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.held = threading.Event()
        self._released = threading.Event()
        self._thread: threading.Thread | None = None
        self._pack = pack
        self.copies: list[torch.Tensor] = []

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        if self._thread is None and threading.current_thread() is not threading.main_thread():
            self._thread = threading.current_thread()
            self.held.set()
            if not self._released.wait(timeout=20):
                raise AssertionError("the held rebuild was never released (the test failed)")
        copy = self._pack(weight)
        if threading.current_thread() is self._thread:
            self.copies.append(copy)
        return copy

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def held_rebuild(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldRebuild]:
    if not PACKS:
        pytest.skip("this torch build has no oneDNN: the linears read plain weights only")
    hold = HeldRebuild(_packed_linear.pack_weight)
    monkeypatch.setattr(_packed_linear, "pack_weight", hold.pack_weight)
    yield hold
    hold.release()  # a failed test leaves no thread waiting


def send(engine: object, seed: int, version: int) -> None:
    with IPCWeightSender([engine]) as sender:
        sender.send(float32_model(seed).named_weights(), weight_version=version)


def test_an_update_commits_without_waiting_for_the_new_packed_copies(held_rebuild, tokens_of_seed):
    engine = engine_with(0)
    send(engine, seed=1, version=1)  # returns while the rebuild of the copies is held
    assert held_rebuild.held.wait(timeout=20)
    assert engine.weight_version == 1
    # No linear reads a copy of the old weights: each multiplies by its new plain weight.
    assert all(copy is None for copy in packed_copies(engine).values())
    assert greedy_tokens(engine) == tokens_of_seed[1]
    held_rebuild.release()
    assert engine.model.wait_for_repack(timeout_s=60)
    copies = packed_copies(engine)
    assert all(copy is not None and copy.is_mkldnn for copy in copies.values())
    assert any(copy is held_rebuild.copies[0] for copy in copies.values())  # it was installed
    assert greedy_tokens(engine) == tokens_of_seed[1]


def test_a_rebuild_overtaken_by_a_committed_update_is_never_installed(held_rebuild, tokens_of_seed):
    engine = engine_with(0)
    send(engine, seed=1, version=1)
    assert held_rebuild.held.wait(timeout=20)  # building copies of seed 1's weights
    send(engine, seed=0, version=2)  # commits while that rebuild is held
    held_rebuild.release()
    assert engine.model.wait_for_repack(timeout_s=60)
    copies = [*packed_copies(engine).values()]
    assert held_rebuild.copies  # it did build a copy, of weights no longer committed
    assert all(copy is not held for copy in copies for held in held_rebuild.copies)
    assert all(copy is not None for copy in copies)  # the second update's rebuild installed
    assert engine.weight_version == 2
    assert greedy_tokens(engine) == tokens_of_seed[0]


def test_a_rebuild_overtaken_by_an_aborted_update_is_never_installed(held_rebuild, tokens_of_seed):
    engine = engine_with(0, weight_update_staging=True)
    send(engine, seed=1, version=1)
    assert held_rebuild.held.wait(timeout=20)
    with (  # seed 0's weights land while the rebuild reads, then the update aborts: restored
        IPCWeightSender([FailsAtFinish(engine)]) as sender,
        pytest.raises(WeightTransferError, match="simulated"),
    ):
        sender.send(float32_model(seed=0).named_weights(), weight_version=2)
    held_rebuild.release()
    assert engine.model.wait_for_repack(timeout_s=60)
    copies = [*packed_copies(engine).values()]
    assert all(copy is not held for copy in copies for held in held_rebuild.copies)
    assert all(copy is not None for copy in copies)  # rebuilt again from the restored weights
    assert engine.weight_version == 1
    assert greedy_tokens(engine) == tokens_of_seed[1]


def test_the_weights_are_not_freed_while_a_rebuild_reads_them(held_rebuild, tokens_of_seed):
    engine = engine_with(0)
    send(engine, seed=1, version=1)
    assert held_rebuild.held.wait(timeout=20)
    # A level-2 sleep frees the weights only once no rebuild reads them: held, it cannot.
    with pytest.raises(EngineStateError, match="still reads the weights"):
        engine.model.release_packed_linears(timeout_s=0)
    held_rebuild.release()
    engine.sleep(level=2)  # waits for the rebuild to stop, then frees the weights
    assert engine.model.wait_for_repack(timeout_s=0)
    assert all(copy is None for copy in packed_copies(engine).values())
    engine.wake_up()
    send(engine, seed=1, version=2)
    engine.resume_generation()
    assert greedy_tokens(engine) == tokens_of_seed[1]


def test_a_shut_down_engine_stops_its_rebuild_after_the_copy_in_hand(held_rebuild):
    # The process's exit waits for the rebuild (see tests/integration): a stopping server
    # must not wait for copies no step will read.
    engine = engine_with(0)
    send(engine, seed=1, version=1)
    assert held_rebuild.held.wait(timeout=20)
    engine.shutdown()
    held_rebuild.release()
    assert engine.model.wait_for_repack(timeout_s=60)
    assert len(held_rebuild.copies) == 1  # the one it was building when the engine stopped
    assert all(copy is None for copy in packed_copies(engine).values())  # none installed


def test_packing_a_packed_model_again_leaves_no_rebuild_to_install_old_copies(
    monkeypatch, tokens_of_seed
):
    if not PACKS:
        pytest.skip("this torch build has no oneDNN: the linears read plain weights only")
    pack, built = _packed_linear.pack_weight, []
    held, go = threading.Event(), threading.Event()

    def pack_then_hold(weight: torch.Tensor) -> torch.Tensor:
        copy = pack(weight)
        if not built and threading.current_thread() is not threading.main_thread():
            built.append(copy)  # a copy of seed 1's weights, held until seed 0's have landed
            held.set()
            assert go.wait(timeout=20), "never released (the test failed)"
        return copy

    monkeypatch.setattr(_packed_linear, "pack_weight", pack_then_hold)
    engine = engine_with(0)
    send(engine, seed=1, version=1)
    assert held.wait(timeout=20)
    engine.model.pack_linears()  # while the rebuild of seed 1's copies runs
    send(engine, seed=0, version=2)
    go.set()
    assert engine.model.wait_for_repack(timeout_s=60)
    assert built and all(copy is not built[0] for copy in packed_copies(engine).values())
    assert greedy_tokens(engine) == tokens_of_seed[0]


def test_a_rebuild_out_of_memory_leaves_plain_weights_and_the_next_update_packs(
    monkeypatch, caplog, tokens_of_seed
):
    if not PACKS:
        pytest.skip("this torch build has no oneDNN: the linears read plain weights only")
    pack, failing = _packed_linear.pack_weight, [True]

    def out_of_memory_on_a_thread(weight: torch.Tensor) -> torch.Tensor:
        if failing[0] and threading.current_thread() is not threading.main_thread():
            raise torch.OutOfMemoryError("simulated")
        return pack(weight)

    monkeypatch.setattr(_packed_linear, "pack_weight", out_of_memory_on_a_thread)
    engine = engine_with(0)
    with caplog.at_level("WARNING", logger=_packed_linear.__name__):
        send(engine, seed=1, version=1)
        assert engine.model.wait_for_repack(timeout_s=60)
    assert [r.getMessage() for r in caplog.records] == [
        "packing 9 linears failed (OutOfMemoryError: simulated): they read their plain weights"
    ]
    assert all(record.exc_info is None for record in caplog.records)  # one line, no stack
    assert all(copy is None for copy in packed_copies(engine).values())
    assert greedy_tokens(engine) == tokens_of_seed[1]
    failing[0] = False
    send(engine, seed=0, version=2)
    assert engine.model.wait_for_repack(timeout_s=60)
    assert all(copy is not None for copy in packed_copies(engine).values())  # all of them again
    assert greedy_tokens(engine) == tokens_of_seed[0]
