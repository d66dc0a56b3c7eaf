"""`LLMEngine`: the synchronous step loop, pause/resume, and the weight-update entry points.

One `step()` schedules a batch, runs it through the model, samples, applies stop conditions and
returns the changed requests' outputs; a request whose computation or sampling fails ends alone
with `finish_reason="error"`. Each output token records the weight version that generated it.
The pause contract (modes, `clear_cache`, queued arrivals, updates only while paused or idle,
torn weights) is described on
[`pause_generation`][weightsync.engine.llm_engine.LLMEngine.pause_generation] and
[`update_weights`][weightsync.engine.llm_engine.LLMEngine.update_weights].

One concept: the engine a caller drives, vLLM's `LLMEngine`. Its length is its public methods'
docstrings (they are the API reference); the work is in the scheduler, the model runner and the
live weights it delegates to.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine._armed_pause import ArmedPause
from weightsync.engine._isolation import run_batch
from weightsync.engine._kv_cache import BlockManager
from weightsync.engine._lora_sync import AdapterVersions
from weightsync.engine._model_runner import ModelRunner
from weightsync.engine._processing import InputProcessor, OutputProcessor
from weightsync.engine._scheduler import Scheduler, check_pause_mode
from weightsync.engine._sequence import Sequence as Seq
from weightsync.engine._sleep import Sleep
from weightsync.engine.config import EngineConfig, _check_optional
from weightsync.engine.loader import load_model
from weightsync.engine.lora import LoRAAdapter, LoRARegistry
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.outputs import RequestOutput, WeightVersion
from weightsync.engine.pause import PauseMode, PauseState
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import ByteTokenizer, Prompt, Tokenizer
from weightsync.engine.weights import (
    AdapterCommit,
    LiveWeights,
    WeightUpdateStatus,
    unwrap_request,
    update_info_of,
)
from weightsync.errors import (
    EngineStateError,
    InvalidRequestError,
    LoRAAdapterNotFoundError,
    TornWeightsError,
)
from weightsync.transfer.base import TransferStats
from weightsync.transfer.checksums import weight_checksums

__all__ = ["LLMEngine"]

logger = logging.getLogger(__name__)


def _placed(
    model: LlamaForCausalLM, config: EngineConfig, device: torch.device
) -> LlamaForCausalLM:
    """`model` moved to `device`, in eval mode, its linears packed if `config` asks (and it pays)."""
    model = model.to(device).eval()
    if config.prepack_linears:
        model.pack_linears()  # LiveWeights has them rebuilt after each commit
    return model


def _lora_registry(
    model: LlamaForCausalLM, config: EngineConfig, device: torch.device
) -> LoRARegistry | None:
    """The engine's LoRA adapters, empty; None when `config` does not enable LoRA."""
    if not config.enable_lora:
        return None
    return LoRARegistry(
        model.config, max_rank=config.max_lora_rank, dtype=model.dtype, device=device,
        refuse_non_finite=config.refuse_non_finite_weights,
    )  # fmt: skip


class LLMEngine:
    """A continuous-batching engine over a Llama-family model, driven one `step()` at a time.

    Args:
        model: A `LlamaForCausalLM`, a preset name (`"debug"`, `"tiny"`, `"small"`) or a local
            Hugging Face directory (see `load_model`). A model is moved to `engine_config.device`.
        engine_config: Scheduler and KV-cache limits, and the device the engine computes on.
        tokenizer: Text prompts to ids, output ids to text (default: the model's own, see `load_model`).
        weight_transfer_config: Transfer backend for `update_weights`; None takes the backend
            named in the init info.
        seed: Seed of a preset's random weights.
        dtype: Parameter dtype of a preset or a loaded directory.
        weight_version: Version of the initial weights.
        worker_index: This engine's index among a transfer group's workers.
        finish_bare_updates: A bare `update_weights` (no `start_weight_update` before it)
            finishes itself once every weight it announced landed. False: it waits for
            `finish_weight_update`, as the replicas behind a data-parallel front do, so that the
            front moves every replica's version at once.

    Raises:
        EngineConfigError: A config of the wrong type, inconsistent limits (e.g. a KV cache
            smaller than one sequence), a missing device, or a directory that does not load.

    >>> engine = LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=64))
    >>> out = engine.generate(["hi"], SamplingParams(temperature=0, max_tokens=4))[0]
    >>> len(out.outputs[0].token_ids), out.outputs[0].weight_versions
    (4, [0, 0, 0, 0])
    """

    def __init__(
        self,
        model: LlamaForCausalLM | str = "tiny",
        *,
        engine_config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        weight_transfer_config: WeightTransferConfig | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        weight_version: WeightVersion = 0,
        worker_index: int = 0,
        finish_bare_updates: bool = True,
    ) -> None:
        _check_optional("engine_config", engine_config, EngineConfig)
        _check_optional("weight_transfer_config", weight_transfer_config, WeightTransferConfig)
        self.config = config = engine_config or EngineConfig()
        self.device = config.resolve_device()
        if isinstance(model, str):
            model, own_tokenizer = load_model(model, seed=seed, dtype=dtype)
            tokenizer = tokenizer or own_tokenizer
        # Before LiveWeights: updates are received into these parameters, on the device.
        self.model = _placed(model, config, self.device)
        self.max_model_len = config.resolve_max_model_len(model.config.max_position_embeddings)
        self.tokenizer: Tokenizer = (tokenizer := tokenizer or ByteTokenizer())
        self.input_processor = InputProcessor(
            tokenizer,
            vocab_size=model.config.vocab_size,
            max_model_len=self.max_model_len,
            seed=config.seed,
            device=self.device,
        )
        self.output_processor = OutputProcessor(tokenizer, max_model_len=self.max_model_len)
        self.block_manager = BlockManager(
            num_blocks=config.num_kv_blocks, block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )  # fmt: skip
        self.scheduler = Scheduler(config, self.block_manager)
        blocks = config.num_kv_blocks
        self.runner = ModelRunner(model, num_blocks=blocks, block_size=config.block_size,
                                  eos_token_ids=frozenset(tokenizer.eos_token_ids))  # fmt: skip
        # The placed model's device, with its index: "cuda" alone names the calling thread's
        # current device, and a load from another thread would put an adapter on another GPU.
        self.loras = _lora_registry(model, config, self.model.device)
        # Callers on other threads only touch these inboxes, which each step drains first.
        self._lock = threading.Lock()
        self._inbox: deque[Seq] = deque()
        self.weights = LiveWeights(
            model, transfer_config=weight_transfer_config, weight_version=weight_version,
            worker_index=worker_index, staging=config.weight_update_staging,
            refuse_non_finite=config.refuse_non_finite_weights,
            finish_bare_updates=finish_bare_updates,
            on_write=self.block_manager.bump_epoch,  # KV of the old weights must not be reused
            scheduler=self.scheduler,
            adapters=self._adapter_versions(),  # what an adapter's live update lands in
        )  # fmt: skip
        self._sleep = Sleep(self.runner, self.weights)
        self.num_steps = 0
        self._abort_inbox: set[str] = set()
        self._live_ids: set[str] = set()
        self._pending_outputs: list[RequestOutput] = []
        self._clear_cache_after_drain = False
        self._shut_down = False  # see shutdown()

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queues a request; it is admitted by a later `step()` (after resume, if paused).

        Safe to call from another thread while a step runs. With `cache_salt`, the request
        shares cached prefixes only with requests of the same salt (vLLM's `cache_salt`). With
        `lora_name`, it runs with the LoRA adapter loaded under that name now, to its end, even
        if another version is loaded under the name meanwhile.

        Raises:
            InvalidRequestError: Duplicate id, empty prompt, unknown token ids, or a prompt that
                leaves no room for output within `max_model_len`.
            LoRAAdapterNotFoundError: No adapter named `lora_name` is loaded.
            EngineStateError: The engine was shut down, or it is asleep.
        """
        self._check_not_shut_down("add_request")
        self._check_awake("add_request")
        with self._lock:
            seq = self.input_processor.process(
                request_id, prompt, sampling_params, cache_salt=cache_salt,
                lora=self._lora_of(lora_name),
            )  # fmt: skip
            if request_id in self._live_ids:
                raise InvalidRequestError(
                    f"request_id {request_id!r} is already in flight; use a unique id"
                )
            self._live_ids.add(request_id)
            self._inbox.append(seq)

    def _adapter_versions(self) -> AdapterVersions | None:
        """What an adapter's live update lands in (None: LoRA is not enabled)."""
        if self.loras is None:
            return None
        return AdapterVersions(
            self.loras,
            max_versions=self.config.max_lora_versions,
            lock=self._lock,
            unfinished=lambda: [*self._inbox, *self.scheduler.waiting, *self.scheduler.running],
            abort=self.abort_request,
        )

    def _lora_of(self, lora_name: str | None) -> LoRAAdapter | None:
        """The current adapter named `lora_name` (None: the base model)."""
        if lora_name is None:
            return None
        return self._lora_registry("a request's lora_name").get(lora_name)

    def _lora_registry(self, what: str) -> LoRARegistry:
        if self.loras is None:
            raise LoRAAdapterNotFoundError(
                f"{what} names a LoRA adapter, but LoRA is not enabled on this engine: build it "
                "with EngineConfig(enable_lora=True) (weightsync serve --enable-lora)"
            )
        return self.loras

    def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, load_inplace: bool = False
    ) -> LoRAAdapter:
        """Loads the PEFT adapter directory `lora_path` under `lora_name` (vLLM's route's call).

        The directory's `adapter_config.json` and `adapter_model.safetensors` are checked
        against the model before anything is registered. Safe from any thread: requests take
        the adapter when they are added, so a step never sees the registry change under it.

        Args:
            lora_name: The name requests give as `lora_name` (over HTTP: as `model`).
            lora_path: The adapter's directory on this machine.
            load_inplace: Replace the adapter loaded under `lora_name` by a new version; the
                requests running on the old version finish on it.

        Returns:
            The adapter loaded.

        Raises:
            LoRAAdapterError: The adapter was refused (the message names the file and the
                tensor), or `lora_name` is loaded and `load_inplace` is False; nothing changed.
            LoRAAdapterNotFoundError: `lora_path` is not a directory, or LoRA is not enabled
                (`EngineConfig.enable_lora`).
        """
        registry = self._lora_registry("load_lora_adapter")
        adapter = registry.load(lora_name, lora_path, load_inplace=load_inplace)
        logger.info(
            "loaded LoRA adapter %r version %d (rank %d) from %s",
            adapter.name, adapter.version, adapter.rank, lora_path,
        )  # fmt: skip
        return adapter

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Unloads the adapter `lora_name`: new requests may not name it; running ones finish.

        Raises:
            LoRAAdapterNotFoundError: No adapter of that name is loaded, or LoRA is not enabled.
        """
        self._lora_registry("unload_lora_adapter").remove(lora_name)
        logger.info("unloaded LoRA adapter %r", lora_name)

    def list_lora_adapters(self) -> list[LoRAAdapter]:
        """The loaded LoRA adapters (the current version of each), in load order."""
        return [] if self.loras is None else self.loras.list()

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], **options: Any
    ) -> list[int]:
        """A conversation's prompt token ids: see `InputProcessor.apply_chat_template`."""
        return self.input_processor.apply_chat_template(messages, **options)

    def tokenize(self, prompt: Prompt, *, truncate_prompt_tokens: int | None = None) -> list[int]:
        """The token ids of a prompt, checked as `add_request` checks it; no side effect.

        `truncate_prompt_tokens` keeps the last tokens, as `SamplingParams` says.

        Raises:
            InvalidRequestError: An empty prompt, text that is not valid Unicode, unknown token
                ids, or a prompt that leaves no room for output within `max_model_len`.
        """
        return self.input_processor.tokenize(prompt, truncate_prompt_tokens=truncate_prompt_tokens)[
            1
        ]

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests by id (unknown or finished ids are ignored); thread-safe.

        Their final outputs, with `finish_reason="abort"`, come from the next `step()`.
        """
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        with self._lock:
            self._abort_inbox |= ids

    def _drain_inbox(self) -> None:
        with self._lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
            aborts, self._abort_inbox = self._abort_inbox, set()
        if aborts:
            self._emit_finished(self.scheduler.abort(aborts))

    def _emit_finished(self, seqs: list[Seq]) -> None:
        for seq in seqs:
            self._pending_outputs.append(seq.to_output())
            with self._lock:
                self._live_ids.discard(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued, running, paused in flight or has an undelivered output."""
        return bool(self._live_ids or self._pending_outputs)

    def num_unfinished_requests(self) -> int:
        """Requests queued, running or frozen by a pause (not those whose end is undelivered)."""
        return len(self._live_ids)

    def unfinished(self, request_ids: Iterable[str]) -> list[str]:
        """Those of `request_ids` that are queued, running or frozen by a pause, in order."""
        with self._lock:
            return [request_id for request_id in request_ids if request_id in self._live_ids]

    def has_work(self) -> bool:
        """Whether `step()` would do anything now (deliver, admit, abort or compute)."""
        pending = self._inbox or self._abort_inbox or self._pending_outputs or self._can_compute()
        return bool(pending or self.scheduler.armed_pause_is_due())

    def _can_compute(self) -> bool:
        # The guard of every forward pass: none runs while an update is open or weights are torn,
        # whatever left the scheduler unpaused.
        return self.scheduler.can_schedule() and not self.weights.holds_generation

    # --- the step loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step and returns the outputs of the requests it changed.

        Paused, or while a weight update is open or weights are torn, it only delivers pending
        outputs (aborts); new requests stay queued. A request that fails ends alone (`"error"`).

        Raises:
            EngineStateError: The engine was shut down.
        """
        self._check_not_shut_down("step")
        self._drain_inbox()
        self.scheduler.fire_armed_pause(self.start_pause)  # see ArmedPause
        if self._can_compute():
            batch = self.scheduler.schedule()
            if batch:
                self.num_steps += 1
                version = self.weights.weight_version
                for seq in run_batch(self.runner, self.output_processor, batch, version):
                    if seq.is_finished:
                        self._emit_finished([seq])
                    else:
                        self._pending_outputs.append(seq.to_output())
                self.scheduler.finish_step(batch)
        if self._clear_cache_after_drain and self.scheduler.state is PauseState.PAUSED:
            self._clear_cache_after_drain = False
            self.scheduler.reset_cache()
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion and returns their final outputs, in order.

        `lora_name` runs every prompt with that LoRA adapter (see `add_request`).

        Outputs of other requests produced meanwhile are returned by the next `step()`.

        Raises:
            EngineStateError: The engine is paused, a weight update is in progress, or weights
                are torn: it would wait forever; or the engine was shut down.
            InvalidRequestError: A bad prompt or sampling parameters.
        """
        self._check_not_shut_down("generate")
        self.weights.check_can_generate("generate()")
        batch, params = InputProcessor.pair_prompts(prompts, sampling_params)
        ids = [f"generate-{uuid.uuid4().hex}" for _ in batch]
        for request_id, prompt, sp in zip(ids, batch, params, strict=True):
            self.add_request(request_id, prompt, sp, lora_name=lora_name)
        finals: dict[str, RequestOutput] = {}
        others: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            if not self.has_work():
                self.weights.check_can_generate("generate()")
                raise EngineStateError("generate() cannot make progress: the engine was paused")
            for output in self.step():
                if output.request_id not in ids:
                    others[output.request_id] = output
                elif output.finished:
                    finals[output.request_id] = output
        self._pending_outputs[:0] = others.values()
        return [finals[i] for i in ids]

    # --- pause / resume -----------------------------------------------------------------------

    def start_pause(self, *, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Enters a pause without running any step: the non-blocking half of `pause_generation`.

        A `wait` pause is then draining until later steps finish its running requests.

        Raises:
            InvalidRequestError: An unknown `mode`; nothing changed (see `check_pause_mode`).
        """
        self.check_pause_mode(mode)
        self._drain_inbox()
        self.weights.caller_paused()  # the caller owns this pause now, not an update
        armed = None
        if self.scheduler.state is PauseState.UNPAUSED:  # paused or draining: it stays armed
            armed, self.scheduler.armed_pause = self.scheduler.armed_pause, None
        aborted = self.scheduler.pause(mode)
        if armed is not None and armed.on_pause is not None:
            armed.on_pause()  # it landed now, or this pause took its place
        self._emit_finished(aborted)
        if clear_cache:
            if self.scheduler.state is PauseState.PAUSED:
                self.scheduler.reset_cache()
            else:
                self._clear_cache_after_drain = True
        logger.info(
            "pause(mode=%s, clear_cache=%s): %s; %d aborted, %d kept",
            mode, clear_cache, self.scheduler.state.value, len(aborted), self.scheduler.num_unfinished,
        )  # fmt: skip

    @staticmethod
    def check_pause_mode(mode: object) -> PauseMode:
        """The pause mode, checked before a pause touches anything: `abort`, `wait` or `keep`.

        A refused pause leaves requests, the pause state and an armed pause as they were.

        Raises:
            InvalidRequestError: Another value.
        """
        return check_pause_mode(mode)

    def arm_pause(
        self,
        after_tokens: int,
        *,
        mode: PauseMode = "keep",
        clear_cache: bool = True,
        on_pause: Callable[[], None] | None = None,
    ) -> None:
        """Arms a pause for when every unfinished request has `after_tokens` output tokens.

        A weightsync extension. The pause starts at the first step boundary, while generation
        runs, where every unfinished request has at least `after_tokens` output tokens (or has
        finished), however late the caller is. To land it exactly there, queue the requests
        while paused, arm, then resume. Any pause that starts before it takes its place (a pause
        of an engine paused or draining already leaves it armed); arming again replaces it.

        Args:
            after_tokens: Output tokens each unfinished request must have.
            mode: The pause's mode.
            clear_cache: Whether the pause drops the KV and prefix caches.
            on_pause: Called (from the stepping thread) once the pause started, or was replaced
                by another pause.

        Raises:
            InvalidRequestError: A negative `after_tokens` or an unknown `mode`.
        """
        armed = ArmedPause(after_tokens, mode, clear_cache, on_pause)
        replaced, self.scheduler.armed_pause = self.scheduler.armed_pause, armed  # one assignment
        if replaced is not None and replaced.on_pause is not None:
            replaced.on_pause()  # whoever waits for the replaced pause learns it will not land

    @property
    def armed_pause(self) -> ArmedPause | None:
        """The pause `arm_pause` armed, until it starts."""
        return self.scheduler.armed_pause

    def pause_generation(
        self,
        *,
        mode: PauseMode = "abort",
        clear_cache: bool = True,
        after_tokens: int | None = None,
    ) -> None:
        """Pauses generation at a step boundary; returns once paused.

        - `abort`: every unfinished request ends now with `finish_reason="abort"` and its
          partial output (delivered by the next `step()`).
        - `wait`: nothing new is admitted; running requests run to completion (this call runs
          the steps; their outputs come from the next `step()`), then the engine pauses.
        - `keep`: running requests freeze and continue after `resume_generation()`.

        With `clear_cache=True` every KV block and the prefix cache are dropped; kept requests
        recompute their KV from their tokens on resume, with the weights current then.
        `clear_cache=False` keeps the old KV (stale after a weight update, but no recompute).
        Requests added while paused are queued and start after resume. Pausing twice is harmless.

        With `after_tokens`, the pause is armed (see `arm_pause`) and this call runs the steps
        until it starts; on an engine paused already, it is armed and lands once generation
        resumes.

        Raises:
            InvalidRequestError: Unknown `mode`, or a negative `after_tokens`.

        >>> engine = LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=64))
        >>> engine.pause_generation(mode="keep")
        >>> engine.is_paused()
        True
        """
        if after_tokens is None:
            self.start_pause(mode=mode, clear_cache=clear_cache)
        else:
            self.arm_pause(after_tokens, mode=mode, clear_cache=clear_cache)
            while self.armed_pause is not None and not self.is_paused():
                self._pending_outputs[:0] = self.step()  # the step that is due starts it
        while self.scheduler.state is PauseState.DRAINING:
            self._pending_outputs[:0] = self.step()

    def resume_generation(self) -> None:
        """Resumes generation (harmless when not paused; cancels a draining `wait` pause).

        Raises:
            TornWeightsError: A failed update left torn weights; land a complete update first.
            WeightUpdateStateError: A weight update is in progress; finish or abort it first.
        """
        self._check_awake("resume_generation()")
        self.weights.check_can_generate("resume_generation()")
        self._clear_cache_after_drain = False
        self.scheduler.resume()

    # --- sleep --------------------------------------------------------------------------------

    def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        """Puts the engine to sleep, as vLLM's `sleep`: pauses it, then frees memory.

        Level 0 stops scheduling only; level 1 also frees the KV cache and puts the weights to
        sleep (no update lands until they wake); level 2 also frees the weights' memory: woken,
        they are torn until an update covering them lands. The pause takes `mode`: `abort` ends
        the requests in flight, `keep` freezes them (they recompute their KV after wake-up),
        `wait` lets them finish first. While asleep no request is taken (`EngineStateError`).
        Sleeping again at a higher level frees more. A refused sleep changes nothing: no
        request ends, the pause state stays (see `check_sleep`).

        Raises:
            InvalidRequestError: A level other than 0, 1 or 2, or an unknown `mode`.
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
            EngineStateError: The engine was shut down.
        """
        level = self.check_sleep(level, mode)
        self.pause_generation(mode=mode, clear_cache=level >= 1)
        self._sleep.sleep(level)

    def check_sleep(self, level: object, mode: object = "abort") -> int:
        """Raises what `sleep(level, mode=mode)` would refuse now; changes nothing.

        Sleep pauses before it frees memory, and a pause may end requests: every refusal is
        decided here first, so that a refused sleep aborts nothing and pauses nothing.

        Returns:
            The level, checked.

        Raises:
            InvalidRequestError: A level other than 0, 1 or 2, or an unknown `mode`.
            WeightUpdateStateError: A weight update is in progress.
            EngineStateError: The engine was shut down.
        """
        self._check_not_shut_down("sleep")
        checked = Sleep.check_level(level)
        self.check_pause_mode(mode)
        self.weights.check_can_sleep()
        return checked

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Wakes what sleeps, as vLLM's `wake_up`: some of `weights`, `kv_cache`, `scheduling`.

        `tags` None wakes all of them. Waking the weights alone lets an update land before the KV cache comes back (a
        colocated trainer's order). Generation resumes once nothing sleeps, unless weights are
        torn (after level 2: until an update covering them lands; then `resume_generation()`).

        Raises:
            InvalidRequestError: An unknown tag; nothing is woken.
        """
        self._sleep.wake(tags)
        if not self._sleep.asleep and not self.weights.holds_generation:
            self.scheduler.resume()

    def is_sleeping(self) -> bool:
        """Whether any part of the engine sleeps."""
        return bool(self._sleep.asleep)

    def _check_awake(self, call: str) -> None:
        """Refuses `call` (a request, a resume) while any part of the engine sleeps."""
        if self._sleep.asleep:
            raise EngineStateError(
                f"{call}: the engine is asleep (sleep level {self._sleep.level}; asleep: "
                f"{sorted(self._sleep.asleep)}): call wake_up() first (over HTTP, POST /wake_up)"
            )

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt prefix (vLLM's route of that name); returns True.

        Requests running keep their KV; only the blocks kept for reuse by later prompts stop
        matching.
        """
        self.block_manager.bump_epoch()
        return True

    def is_paused(self) -> bool:
        """Whether generation is paused (a draining `wait` pause is not paused yet)."""
        return self.scheduler.state is PauseState.PAUSED

    @property
    def pause_state(self) -> PauseState:
        """The pause state: unpaused, draining (a `wait` pause in progress) or paused."""
        return self.scheduler.state

    # --- weights ------------------------------------------------------------------------------

    @property
    def weight_version(self) -> WeightVersion:
        """Version of the current weights: the trainer's label, or the count of updates."""
        return self.weights.weight_version

    @property
    def worker_index(self) -> int:
        """This engine's index among a transfer group's workers (its broadcast rank is 1 + it)."""
        return self.weights.worker_index

    def get_world_size(self) -> int:
        """Transfer workers this engine holds: 1 (vLLM's name, as its HTTP route has it)."""
        return 1

    def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """Joins a trainer's transfer group: `{"init_info": {...}}`, as vLLM's `LLM` takes it.

        Blocks until the group forms (the trainer's first send) or its timeout passes.
        """
        self._check_not_shut_down("init_weight_transfer_engine")
        self.weights.init_transfer_engine(
            unwrap_request(request, "init_info", "init_weight_transfer_engine")
        )

    def start_weight_update(
        self, *, lora_name: str | None = None, lora_config: Mapping[str, Any] | None = None
    ) -> None:
        """Opens a weight-update transaction, as vLLM's `start_weight_update`.

        Accepted while paused or idle. From now until `finish_weight_update` or
        `abort_weight_update` no forward pass runs; requests that arrive are queued. An idle,
        unpaused engine pauses itself for the transaction and resumes after it. A transaction
        left open by a refused `update_weights` is ended first, unapplied (as by
        `abort_weight_update()`), and a new one begins.

        With `lora_name` (a weightsync extension), the transaction updates that LoRA adapter
        alone: its messages carry the adapter's A and B tensors under PEFT's names, checked
        against the adapter before any byte moves, and land in a new version of it. Nothing
        pauses and the model's weight version stays: running requests keep the adapter version
        they were admitted with, requests admitted after `finish_weight_update` get the new one.
        `lora_config` (PEFT's `r`, `lora_alpha`, `target_modules`, `use_rslora`) creates an
        adapter that is not loaded yet, or gives a loaded one a new shape; without it the
        loaded adapter's shapes are the contract. One transaction is open at a time, of the
        model's weights or of an adapter.

        Raises:
            EngineBusyError: Requests are in flight and the engine is not paused (an update of
                the model's weights only).
            EngineStateError: The weights are asleep, the engine was shut down, or an adapter
                is named and the engine serves none (`enable_lora`).
            LoRAAdapterNotFoundError: `lora_name` is not loaded and no `lora_config` is given.
            LoRAAdapterError: `lora_config` is refused (a rank above `max_lora_rank`, say).
            WeightUpdateStateError: A transaction is already open.
        """
        self._check_not_shut_down("start_weight_update")
        self.weights.start(lora_name=lora_name, lora_config=lora_config)

    def update_weights(self, request: Mapping[str, Any]) -> TransferStats:
        """Receives one weight update message: `{"update_info": {...}}`, as vLLM's `LLM` takes it.

        `{"weight_dir": DIR}` (prime-rl's form) loads the checkpoint directory DIR through the
        `disk` backend, whatever backend the engine has: a bare update, checked and loaded
        as one (see `weightsync.transfer.disk`).

        Accepted while paused or idle, inside a transaction (`start_weight_update` ...
        `finish_weight_update`) or bare: a bare update is a transaction of its own, finished
        once every weight it announced has landed (one call for a broadcast; the announcement
        and its parts for IPC). The update is validated against the model before any byte moves;
        a message of another update is refused and changes nothing. If the transfer fails after
        writing part of the weights, the transaction ends, and the engine pauses and refuses to
        generate until an update covering them lands (with staging, the previous weights are
        restored instead). Cached prefixes are forgotten whenever weight bytes change.

        Returns:
            What was received and how fast.

        Raises:
            EngineBusyError: Requests are in flight and the engine is not paused; the trainer
                learns it too (a broadcast's handshake fails with this reason on every rank).
            WeightValidationError: The message was refused; nothing changed.
            WeightTransferError: The transfer failed (see `partially_applied`).
        """
        self._check_not_shut_down("update_weights")
        return self.weights.update(update_info_of(request))

    def finish_weight_update(self, weight_version: WeightVersion | None = None) -> bool:
        """Ends the open transaction and moves the weight version, as vLLM's call of that name.

        The version becomes `weight_version`, else the label the update carried, else the count
        of updates. It moves only if every announced weight landed and no weight is torn. The
        engine then returns to the pause state it had before the transaction.

        After an `update_weights` of this update was refused (and not sent again), the update
        ends unapplied instead, as `abort_weight_update()` would end it: the previous weights
        and version stay, and the engine returns to its pause state. So a client that knows
        only vLLM's calls (start, update, finish, resume) gets back to serving after a refusal.

        An adapter's transaction (`start_weight_update(lora_name=...)`) ends with the new
        version of the adapter built from the tensors it brought (each one must have landed),
        labelled `weight_version` (else the adapter's count of versions);
        `last_adapter_commit` then says which older versions the engine dropped to stay within
        `EngineConfig.max_lora_versions`.

        Returns:
            Whether the update was applied: False when it ended unapplied after a refusal.

        Raises:
            WeightUpdateStateError: No transaction is open.
            IncompleteWeightUpdateError: Announced weights are missing; the transaction stays
                open (send them, or `abort_weight_update()`).
            TornWeightsError: Weights torn by an earlier failure remain; the version stays. Or
                an `update_weights` was refused after others of the update had landed, without
                staging: the update ends and those weights are torn.
            NonFiniteWeightsError: The engine refuses non-finite weights and one landed with a
                NaN or an infinity; the update ends (restored with staging, else torn).
            WeightValidationError: `weight_version` is not a string of at most 256 characters
                or a 64-bit int.
        """
        return self.weights.finish(weight_version)

    @property
    def last_adapter_commit(self) -> AdapterCommit | None:
        """What the last finish of an adapter's update did (its version, versions dropped)."""
        return self.weights.last_adapter_commit

    def check_finish_weight_update(self, weight_version: WeightVersion | None = None) -> None:
        """Raises what `finish_weight_update(weight_version)` would raise now; changes nothing.

        A data-parallel front asks every replica this before any of them moves its version.
        """
        self.weights.check_finish(weight_version)

    @property
    def weight_update(self) -> WeightUpdateStatus | None:
        """The weight update in progress (explicit or bare, how far it got), or None."""
        return self.weights.status()

    def update_weight_version(self, new_version: WeightVersion) -> None:
        """Relabels the current weights (vLLM's `update_weight_version`); no byte changes.

        Raises:
            WeightUpdateStateError: A weight update is in progress: its finish sets the version.
            WeightValidationError: `new_version` is not a string of at most 256 characters or
                a 64-bit int.
        """
        self.weights.relabel(new_version)

    def reset_weights(self) -> None:
        """Writes zeros over every weight, as vLLM's weight-checker `reset` does.

        A test of an update's coverage: reset, update, then compare digests with the trainer's;
        a weight the update missed shows as zero. Requests then generate from zeros until an
        update lands, and their tokens carry the current version label: use it on an engine
        that serves nothing else. Accepted while paused or idle, like an update.

        Raises:
            EngineBusyError: Requests are in flight and the engine is not paused.
            WeightUpdateStateError: A weight update is in progress.
            EngineStateError: The weights are asleep.
        """
        self.weights.check_idle("weight_checker reset")
        self.weights.reset()

    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of every weight's bytes, by Hugging Face name (see `weight_checksums`).

        Raises:
            TornWeightsError: Weights are torn: the digests would describe half-written (or,
                after a level-2 sleep, empty) weights. The message names the cause.
            EngineStateError: A weight update is in progress, or the weights are asleep: the
                digests would describe weights that are about to change.
        """
        if self.weights.is_torn and not self.weights.in_update:
            raise TornWeightsError(
                f"weight_checker: {self.weights.torn_cause()}; check after an update that "
                "covers them lands"
            )
        if self.weights.holds_generation or self.weights.asleep:
            raise EngineStateError(
                "weight_checker: a weight update is in progress, or the weights are torn or "
                "asleep; check after finish_weight_update (or wake_up)"
            )
        return weight_checksums(self.model.named_weights())

    def abort_weight_update(self) -> bool:
        """Ends the open transaction on purpose (a weightsync extension). Harmless without one.

        If no byte moved, the engine is as before the transaction and resumes if it was running.
        If bytes moved, the touched weights are torn (the engine stays paused until an update
        covering them lands), or restored from the staged copy when staging is on.

        Returns:
            Whether a transaction was open.
        """
        return self.weights.abort()

    def shutdown_weight_transfer_engine(self) -> None:
        """Leaves the trainer's transfer and frees what it held, as vLLM's call of that name.

        A trainer calls it when it closes: the group's connections and port, or the mappings
        of its shared memory, go now. A later `init_weight_transfer_engine` joins a new
        transfer (of any backend). The weights and their version stay.

        Raises:
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
        """
        self.weights.release_transfer_engine()

    def shutdown(self) -> None:
        """Ends the engine: releases its transfer engine and runs nothing more. Safe twice.

        Requests still in flight are not stepped further, and a rebuild of the packed copies
        in flight stops after the copy in hand (see `LlamaForCausalLM.cancel_repack`). Every
        later call that would generate or update (`generate`, `add_request`, `step`,
        `init_weight_transfer_engine`, `start_weight_update`, `update_weights`) raises
        `EngineStateError`, as an `AsyncEngine` shut down does; create a new engine instead.
        To leave a trainer's transfer and go on generating, call
        `shutdown_weight_transfer_engine()`.
        """
        self._shut_down = True
        # No step reads the copies any more, and the process's exit waits for a rebuild in
        # flight: it stops after the copy in hand.
        self.model.cancel_repack()
        self.weights.shutdown()

    def _check_not_shut_down(self, call: str) -> None:
        if self._shut_down:
            raise EngineStateError(
                f"{call}: this LLMEngine was shut down; create a new one (to leave a trainer's "
                "transfer only, call shutdown_weight_transfer_engine() instead)"
            )
