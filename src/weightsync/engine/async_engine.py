"""`AsyncEngine`: an asyncio front over `LLMEngine` that streams outputs and stays responsive.

The [`LLMEngine`][weightsync.engine.llm_engine.LLMEngine] steps back to back on a thread of its
own, so the event loop keeps serving `generate` streams and control calls while the model computes,
and the model never waits for the event loop: each step's outputs are handed to the loop without
waiting for it, which delivers them to the streams on its next turn. New requests and aborts reach
the step thread through the engine's thread-safe inboxes, drained at each step boundary. Control
calls (`pause_generation`, `resume_generation`, `update_weights`) park the step thread at the next
step boundary and act while it is parked, so they act exactly between two steps: a pause waits for
at most the step in flight. The weight-update calls go
straight to the engine's [`LiveWeights`][weightsync.engine.weights.LiveWeights] (the transaction
and what guards it); a transfer call runs on a thread of its own (`TRANSFER_THREAD_NAME`).

One concept: the asyncio front of one engine, its step loop, its request streams and every
control call between two steps; each call is a few lines over the engine call it orders.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from weightsync.engine._armed_pause import ArmedPause
from weightsync.engine._cores import ComputeThreads
from weightsync.engine._stats import ServingStats
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.lora import LoRAAdapter
from weightsync.engine.outputs import RequestOutput, WeightVersion
from weightsync.engine.pause import PauseMode, PauseState
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Prompt
from weightsync.engine.weights import (
    AdapterCommit,
    WeightUpdateStatus,
    unwrap_request,
    update_info_of,
)
from weightsync.errors import EngineConfigError, EngineStateError, InvalidRequestError
from weightsync.transfer.base import TransferStats

__all__ = ["STEP_THREAD_NAME", "TRANSFER_THREAD_NAME", "AsyncEngine"]

logger = logging.getLogger(__name__)


_T = TypeVar("_T")


STEP_THREAD_NAME = "weightsync-step"
"""The name of the thread on which an `AsyncEngine` runs its steps."""

_IDLE_POLL_S = 1.0  # how often an idle step thread checks that its event loop is still open


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # done: its caller was cancelled
        waiter.set_result(None)


TRANSFER_THREAD_NAME = "weightsync-transfer"
"""The name of the thread each transfer-engine call of an `AsyncEngine` runs on.

Such a call waits in torch (a rendezvous, a broadcast) up to its `timeout_s` and cannot be
interrupted. It runs on a thread of its own rather than on asyncio's executor, whose threads the
event loop's close waits for: a process that is stopping may then exit without waiting for it
with `os._exit` (`weightsync serve` does, on SIGINT or SIGTERM). The interpreter's own exit
still waits for it, as for any thread: torch must not be torn down under a call in progress."""


async def _on_transfer_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Runs `fn(*args)` on a thread named `TRANSFER_THREAD_NAME`; returns its result."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, raised there
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: no one awaits it
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=TRANSFER_THREAD_NAME).start()
    return await done


async def _to_thread_uninterrupted(fn: Callable[..., _T], *args: Any) -> _T:
    """Runs `fn` on a transfer thread; a cancelled caller still waits for `fn` to end."""
    # A transfer cannot be interrupted halfway, so the locks its caller holds stay held until it
    # ends: otherwise a step could run on half-written weights.
    work = asyncio.ensure_future(_on_transfer_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        logger.info("cancelled during %s: waiting for it to end first", fn.__name__)
        await asyncio.wait([work])
        raise


class _Closed(Exception):
    """Queued to open streams by `shutdown`: the stream ends with an `EngineStateError`."""


class AsyncEngine:
    """Serves streaming requests from asyncio, with pause/resume and live weight updates.

    Takes the arguments of `LLMEngine` (or wrap an existing one with `from_engine`). Use it from
    one event loop; `shutdown()` (or `async with`) stops its loop and threads.

    >>> import asyncio
    >>> async def main():
    ...     async with AsyncEngine("debug") as engine:
    ...         async for out in engine.generate("hi", SamplingParams(temperature=0, max_tokens=3)):
    ...             pass
    ...         return out.outputs[0].weight_versions
    >>> asyncio.run(main())
    [0, 0, 0]
    """

    def __init__(self, model: Any = "tiny", **engine_kwargs: Any) -> None:
        if isinstance(model, LLMEngine) and engine_kwargs:
            raise EngineConfigError(
                f"AsyncEngine got an LLMEngine and engine arguments {sorted(engine_kwargs)}: "
                "configure the LLMEngine itself, then pass it alone (or use from_engine)"
            )
        self._init(model if isinstance(model, LLMEngine) else LLMEngine(model, **engine_kwargs))

    @classmethod
    def from_engine(
        cls, engine: LLMEngine, *, compute_threads: ComputeThreads | None = None
    ) -> AsyncEngine:
        """Wraps an existing `LLMEngine` (which must not be stepped by anyone else).

        With `compute_threads`, the step thread calls its `adjust()` before each step, which sets
        how many torch threads the step computes on (`weightsync serve` does, unless given
        `--num-threads`); without, steps compute on torch's threads as the process set them.
        torch starts each new thread from the count set last by any thread, so threads made
        after a step (a transfer's, your own) start from the step thread's count.
        """
        async_engine = cls(engine)
        async_engine._compute_threads = compute_threads
        return async_engine

    def _init(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._compute_threads: ComputeThreads | None = None  # see from_engine
        self._weights = engine.weights  # the transaction and what guards it: called directly
        self.stats = ServingStats()  # requests, pauses and updates, for a metrics page
        self._lock = asyncio.Lock()  # one control call at a time (see _at_step_boundary)
        self._transfer_lock = asyncio.Lock()  # one transfer-engine call at a time
        # One weight-update call (or sleep, wake-up) at a time, taken before the others: an
        # answer read right after a call describes the update as the call left it, and no update
        # opens while a sleep's `wait` pause drains.
        self._update_calls = asyncio.Lock()
        self._step_done = asyncio.Event()  # set, then replaced, each time outputs are handed over
        self._idle_waiters: list[tuple[int, asyncio.Future[None]]] = []  # see wait_until_idle
        # The pause armed last, and the event set when it starts or is replaced (see arm_pause).
        self._armed: tuple[ArmedPause | None, asyncio.Event] = (None, asyncio.Event())
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._error: BaseException | None = None
        self._closed = False
        self.num_rendering = 0  # chat templates rendering now (see apply_chat_template)
        self._updating = False  # an update_weights holds the engine (no step runs)
        # Shared with the step thread, under `_cond`; the step thread waits on it when idle or
        # parked, and every change that may give it work notifies it.
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stepping = False  # the step thread runs (started, not stopped nor dead)
        self._stopping = False
        self._park_wanted: asyncio.Future[None] | None = None  # a control call waits for it
        self._parked = False  # a control call holds the step thread at a step boundary
        self._outbox: list[RequestOutput] = []  # outputs not yet handed to the streams
        self._handover_due = False  # a _hand_over call is scheduled on the loop
        self._idle_asked = 0  # tickets of wait_until_idle calls, see _answer_idle
        self._idle_answered = 0

    # --- the loop -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._closed:
            raise EngineStateError("this AsyncEngine was shut down; create a new one")
        if self._error is not None:
            raise EngineStateError(f"the engine loop died: {self._error!r}") from self._error
        if self._thread is None:
            self._loop = loop = asyncio.get_running_loop()
            self._stepping = True
            self._thread = threading.Thread(
                target=self._step_loop, args=(loop,), name=STEP_THREAD_NAME, daemon=True
            )
            self._thread.start()

    def _notify(self) -> None:
        """Tells the step thread to look for work again (a request, an abort, a resume)."""
        with self._cond:
            self._cond.notify_all()

    def _step_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The step thread: steps while there is work and parks for control calls."""
        try:
            while self._next_step_is_due(loop):
                if self._compute_threads is not None:
                    self._compute_threads.adjust()
                self._hand_off(loop, self.engine.step())
        except Exception as exc:
            logger.exception("engine step failed; failing every open stream")
            self._post(loop, self._fail, exc)
        finally:
            with self._cond:
                self._stepping = False
                self._grant_park(loop)  # a control call waiting for a boundary gets it now

    def _next_step_is_due(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Waits (on the step thread) until a step is due; False once the thread must stop."""
        with self._cond:
            while not self._stopping:
                self._grant_park(loop)
                if not self._parked and self.engine.has_work():
                    return True
                if self._compute_threads is not None:
                    self._compute_threads.rest()  # other work is measured while stepping
                if not self._parked and self._idle_asked > self._idle_answered:
                    self._idle_answered = self._idle_asked
                    self._post(loop, self._answer_idle, self._idle_answered)
                # Bounded, so that a thread whose event loop was closed without shutdown() ends.
                self._cond.wait(timeout=_IDLE_POLL_S)
                if loop.is_closed():
                    return False
            return False

    def _grant_park(self, loop: asyncio.AbstractEventLoop) -> None:
        # Under _cond, at a step boundary (or once the thread has stopped).
        wanted, self._park_wanted = self._park_wanted, None
        if wanted is not None:
            self._parked = True
            self._post(loop, _settle, wanted)

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: no one is left to tell
            loop.call_soon_threadsafe(fn, *args)

    def _hand_off(self, loop: asyncio.AbstractEventLoop, outputs: list[RequestOutput]) -> None:
        """Queues a step's outputs for the event loop; at most one hand-over call is pending."""
        with self._cond:
            self._outbox.extend(outputs)
            if self._handover_due:
                return
            self._handover_due = True
        self._post(loop, self._hand_over)

    def _hand_over(self) -> None:
        """On the event loop: delivers every output the step thread has queued."""
        with self._cond:
            outputs, self._outbox = self._outbox, []
            self._handover_due = False
        self._dispatch(outputs)
        self._step_done.set()
        self._step_done = asyncio.Event()

    def _fail(self, exc: Exception) -> None:
        """On the event loop: the step thread died of `exc`."""
        self._hand_over()  # the outputs of the steps before it
        self._error = exc
        for queue in self._streams.values():
            queue.put_nowait(exc)
        self._step_done.set()
        self._settle_idle_waiters(EngineStateError(f"the engine loop died: {exc!r}"))

    @contextlib.asynccontextmanager
    async def _at_step_boundary(self) -> AsyncIterator[None]:
        """Holds the step thread parked between two steps, with every earlier output delivered.

        Control calls act inside it, one at a time: a call waits for at most the step in flight.
        """
        async with self._lock:
            waiter = asyncio.get_running_loop().create_future()
            with self._cond:
                if self._stepping:
                    self._park_wanted = waiter
                    self._cond.notify_all()
                else:  # not started, stopped or dead: no step can run
                    self._parked = True
                    waiter.set_result(None)
            try:
                await waiter
                self._hand_over()  # the streams see every step before this boundary
                yield
            finally:
                with self._cond:
                    if self._park_wanted is waiter:  # cancelled before it was granted
                        self._park_wanted = None
                    self._parked = False
                    self._cond.notify_all()

    def _answer_idle(self, ticket: int) -> None:
        """On the event loop: the step thread found no work after `wait_until_idle` #ticket."""
        waiters = self._idle_waiters
        self._idle_waiters = [(t, w) for t, w in waiters if t > ticket]
        for t, waiter in waiters:
            if t <= ticket and not waiter.done():  # done: its caller was cancelled
                waiter.set_result(None)

    def _settle_idle_waiters(self, error: Exception) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for _, waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    async def _next_step(self) -> None:
        """Waits until the next step's outputs are handed over (or the loop dies or shuts down)."""
        await self._step_done.wait()
        if self._error is not None:
            raise EngineStateError(f"the engine loop died: {self._error!r}") from self._error
        if self._closed:
            raise EngineStateError("the engine was shut down while this call waited for it")

    # --- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's cumulative output as steps change it.

        The engine does not wait for the stream: when several steps ran since the stream last
        read, it gets the newest output, which carries every token since.

        `cache_salt`, `lora_name`: see `LLMEngine.add_request`.

        A request submitted while paused is queued and starts after resume. Leaving the stream
        early (break, cancellation) aborts the request.

        Raises:
            InvalidRequestError: A bad prompt, sampling parameters or duplicate `request_id`.
            LoRAAdapterNotFoundError: No adapter named `lora_name` is loaded.
            EngineStateError: The engine was shut down or its loop died.
        """
        self._start()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError(
                f"request_id {request_id!r} is already streaming; use a unique id"
            )
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        arrived_at = time.monotonic()
        self.engine.add_request(
            request_id, prompt, sampling_params, cache_salt=cache_salt, lora_name=lora_name
        )
        self._streams[request_id] = queue
        self._notify()
        finished = False
        last: RequestOutput | None = None
        first_token_at: float | None = None
        try:
            while not finished:
                item = await queue.get()
                while not queue.empty() and not isinstance(item, BaseException):
                    item = queue.get_nowait()  # outputs are cumulative: the newest says it all
                if isinstance(item, _Closed):
                    raise EngineStateError("the engine was shut down while this request ran")
                if isinstance(item, BaseException):
                    raise EngineStateError(f"the engine loop died: {item!r}") from item
                finished, last = item.finished, item
                if first_token_at is None and any(o.token_ids for o in item.outputs):
                    first_token_at = time.monotonic()
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort_request(request_id)
                self._notify()
            self.stats.record_request(last, arrived_at, first_token_at)

    # --- LoRA adapters ---------------------------------------------------------------------------

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, load_inplace: bool = False
    ) -> LoRAAdapter:
        """Loads a PEFT adapter directory; see `LLMEngine.load_lora_adapter`.

        The files are read and checked on a worker thread, so streams keep flowing. The step
        thread never reads the registry (a request holds its adapter from `generate` on), so
        no step boundary is needed: the registry's own lock orders loads against `generate`.
        """
        return await asyncio.to_thread(
            self.engine.load_lora_adapter, lora_name, lora_path, load_inplace=load_inplace
        )

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unloads an adapter; see `LLMEngine.unload_lora_adapter`."""
        self.engine.unload_lora_adapter(lora_name)

    def list_lora_adapters(self) -> list[LoRAAdapter]:
        """The loaded LoRA adapters; see `LLMEngine.list_lora_adapters`."""
        return self.engine.list_lora_adapters()

    def tokenize(self, prompt: Prompt, *, truncate_prompt_tokens: int | None = None) -> list[int]:
        """The token ids of a prompt, checked as `generate` checks it; see `LLMEngine.tokenize`."""
        return self.engine.tokenize(prompt, truncate_prompt_tokens=truncate_prompt_tokens)

    async def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], **options: Any
    ) -> list[int]:
        """A conversation's prompt token ids; see `LLMEngine.apply_chat_template`.

        The template renders and its text is encoded on a worker thread: a template is the
        model publisher's code, and while it runs (up to its deadline) the event loop keeps
        serving every other request. `num_rendering` counts the renders in progress.
        """
        self.num_rendering += 1
        try:
            return await asyncio.to_thread(self.engine.apply_chat_template, messages, **options)
        finally:
            self.num_rendering -= 1

    @property
    def max_model_len(self) -> int:
        """Longest sequence, in tokens, that a request may reach."""
        return self.engine.max_model_len

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its stream ends with `finish_reason="abort"`."""
        self.engine.abort_request(request_id)
        self._notify()

    def close_streams_held_by_update(self) -> int:
        """Ends every open stream now, if an `update_weights` holds the engine; returns how many.

        An aborted request's stream ends at the next step, and no step runs until the update
        ends (up to its `timeout_s`). A server that stops cannot wait for that: each stream ends
        now with an `EngineStateError`, as at `shutdown`.
        """
        if not self._updating:
            return 0
        for queue in self._streams.values():
            queue.put_nowait(_Closed())
        return len(self._streams)

    # --- pause / resume -----------------------------------------------------------------------

    async def pause_generation(
        self,
        *,
        mode: PauseMode = "abort",
        clear_cache: bool = True,
        after_tokens: int | None = None,
    ) -> PauseMode:
        """Pauses at a step boundary and returns once paused; see `LLMEngine.pause_generation`.

        `abort` and `keep` return after at most the step in flight; their aborted streams have
        received their final output by then. `wait` returns when the running requests finished.
        Calling it again is harmless. If `resume_generation()` cancels a draining `wait` pause,
        this returns with the engine running.

        A pause armed earlier (`arm_pause`, or `after_tokens` here) lands where it was armed
        to: while requests run, this call waits for it and takes its mode. On an idle, draining
        or paused engine there is nothing to wait for, and the pause starts now (on a paused
        engine the armed pause stays armed, and lands once generation resumes).

        Returns:
            The mode of the pause that landed (an armed pause's own).

        Raises:
            InvalidRequestError: An unknown `mode` or a negative `after_tokens`; nothing changed.
        """
        self._start()
        self.engine.check_pause_mode(mode)  # before an armed pause is waited for or replaced
        if after_tokens is not None:
            await self.arm_pause(after_tokens, mode=mode, clear_cache=clear_cache)
            if self.engine.is_paused():
                return mode
        if self._waits_for_armed_pause():
            # Each armed pause's event is set by the step that starts it, by a pause before it,
            # or by arming again: then the pause armed last is the one to wait for.
            while self._waits_for_armed_pause():
                await self._armed[1].wait()
            armed = self._armed[0]  # it landed (or a pause started before it): its mode holds
            if armed is not None:
                mode, clear_cache = armed.mode, armed.clear_cache
        async with self._at_step_boundary():
            self.engine.start_pause(mode=mode, clear_cache=clear_cache)
            if self.engine.is_paused():
                self._dispatch(self.engine.step())  # paused: delivers aborts, computes nothing
        self._notify()
        drained = False
        while self.engine.pause_state is PauseState.DRAINING:
            drained = True
            await self._next_step()
        if drained:
            async with self._at_step_boundary():
                pass  # the streams that drained have their final outputs before this returns
        if self.engine.is_paused():  # not a `wait` pause that a resume called off
            self.stats.record_pause(mode)
        return mode

    def _waits_for_armed_pause(self) -> bool:
        """Whether a pause must wait for the armed one: it lands only while requests run."""
        engine = self.engine
        running = engine.pause_state is PauseState.UNPAUSED and engine.has_unfinished_requests()
        return running and engine.armed_pause is not None

    async def arm_pause(
        self, after_tokens: int, *, mode: PauseMode = "keep", clear_cache: bool = True
    ) -> None:
        """Arms a pause for when every unfinished request has `after_tokens` output tokens.

        Returns at once; see `LLMEngine.arm_pause`. The next `pause_generation` waits for it.

        Raises:
            InvalidRequestError: A negative `after_tokens` or an unknown `mode`.
        """
        self._start()
        loop = asyncio.get_running_loop()
        landed = asyncio.Event()

        def on_pause() -> None:  # called on the stepping thread
            loop.call_soon_threadsafe(landed.set)

        async with self._at_step_boundary():
            self.engine.arm_pause(
                after_tokens, mode=mode, clear_cache=clear_cache, on_pause=on_pause
            )
            self._armed = (self.engine.armed_pause, landed)
        self._notify()

    async def resume_generation(self) -> None:
        """Resumes generation (harmless when running).

        Raises:
            TornWeightsError: A failed update left torn weights; land a complete update first.
        """
        self._start()
        async with self._at_step_boundary():
            self.engine.resume_generation()
            self.stats.record_resume()
        self._notify()

    async def is_paused(self) -> bool:
        """Whether generation is paused."""
        return self.engine.is_paused()

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        """Pauses (`mode`) and frees memory; see `LLMEngine.sleep`.

        A `wait` sleep lets the running requests finish first, as a `wait` pause does. A sleep
        that would be refused is refused before the pause: it ends no request and pauses nothing.

        Raises:
            InvalidRequestError: A level other than 0, 1 or 2, or an unknown `mode`.
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
        """
        self._start()
        # Checked before the pause, which may end requests.
        async with self._update_calls:  # no update opens while a `wait` pause drains
            level = self.engine.check_sleep(level, mode)
            await self.pause_generation(mode=mode, clear_cache=level >= 1)
            async with self._at_step_boundary():
                self.engine.sleep(level, mode="keep")  # paused already: nothing more is aborted
                self._dispatch(self.engine.step())  # delivers what the pause ended
        self._notify()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wakes `tags` (all when None); see `LLMEngine.wake_up`."""
        self._start()
        async with self._update_calls, self._at_step_boundary():
            self.engine.wake_up(tags)
        self._notify()

    async def is_sleeping(self) -> bool:
        """Whether any part of the engine sleeps."""
        return self.engine.is_sleeping()

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt prefix; see `LLMEngine.reset_prefix_cache`."""
        async with self._at_step_boundary():
            return self.engine.reset_prefix_cache()

    def unfinished(self, request_ids: Iterable[str]) -> list[str]:
        """Those of `request_ids` that are queued, running or frozen by a pause, in order."""
        return self.engine.unfinished(request_ids)

    def num_unfinished_requests(self) -> int:
        """Requests queued, running or frozen by a pause."""
        return self.engine.num_unfinished_requests()

    # --- weights ------------------------------------------------------------------------------

    @property
    def weight_version(self) -> WeightVersion:
        """Version of the current weights."""
        return self.engine.weight_version

    @property
    def num_steps(self) -> int:
        """Forward passes run so far."""
        return self.engine.num_steps

    async def wait_until_idle(self) -> None:
        """Returns once the step loop has looked for work after this call and found none.

        Then every step that was due for the requests and calls made before this call has run, and
        no step runs until new work arrives or a pause ends. An observation hook: it tells a caller
        (a test, a monitor) that nothing more happens now, without polling. While requests can
        run it waits for them to finish, so bound it (`asyncio.wait_for`) where work may not end.

        Raises:
            EngineStateError: The engine was shut down or its loop died.

        >>> import asyncio
        >>> async def main():
        ...     async with AsyncEngine("debug") as engine:
        ...         await engine.pause_generation(mode="keep")
        ...         queued = asyncio.create_task(engine.generate("hi").__anext__())
        ...         await engine.wait_until_idle()  # the loop saw the request and runs nothing
        ...         steps = engine.num_steps
        ...         queued.cancel()
        ...         return steps
        >>> asyncio.run(main())
        0
        """
        self._start()
        waiter = asyncio.get_running_loop().create_future()
        with self._cond:  # the step thread answers tickets it has looked for work after
            self._idle_asked += 1
            self._idle_waiters.append((self._idle_asked, waiter))
            self._cond.notify_all()  # an idle step thread looks again, about the work of now
        await waiter

    async def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """Joins a trainer's transfer group (`{"init_info": {...}}`), off the event loop.

        Steps continue meanwhile: joining touches no weights. See
        `LLMEngine.init_weight_transfer_engine`.
        """
        self._start()
        init_info = unwrap_request(request, "init_info", "init_weight_transfer_engine")
        async with self._transfer_lock:
            await _to_thread_uninterrupted(self._weights.init_transfer_engine, init_info)

    async def start_weight_update(
        self, *, lora_name: str | None = None, lora_config: Mapping[str, Any] | None = None
    ) -> None:
        """Opens a weight-update transaction; see `LLMEngine.start_weight_update`.

        With `lora_name`, the update is a LoRA adapter's: steps go on while its messages land.
        """
        self._start()
        async with self._update_calls, self._at_step_boundary():
            with self.stats.counting_update_failures():
                self._weights.start(lora_name=lora_name, lora_config=lora_config)

    async def update_weights(self, request: Mapping[str, Any]) -> TransferStats:
        """Receives one update message (`{"update_info": {...}}`), off the event loop.

        No step runs until it ends; see `LLMEngine.update_weights` for when it is accepted and
        what a failure leaves behind. In a LoRA adapter's update, steps go on meanwhile: the
        message lands in tensors no request uses until the update finishes.
        """
        self._start()
        update_info = update_info_of(request)
        try:
            async with self._update_calls, self._transfer_lock:
                status = self._weights.status()
                if status is not None and status.lora_name is not None:
                    with self.stats.counting_update_failures():
                        stats = await _to_thread_uninterrupted(self._weights.update, update_info)
                    self.stats.record_update_message(stats.num_bytes, stats.seconds)
                    return stats
                async with self._at_step_boundary():
                    bare = status is None
                    self._updating = True
                    try:
                        with self.stats.counting_update_failures():
                            stats = await _to_thread_uninterrupted(
                                self._weights.update, update_info
                            )
                    finally:
                        self._updating = False
                    self.stats.record_update_message(stats.num_bytes, stats.seconds)
                    if bare and self._weights.status() is None:  # a whole update, finished
                        self.stats.weight_updates += 1
                    return stats
        finally:
            self._notify()  # a bare update that ended resumes the engine it paused

    async def finish_weight_update(self, weight_version: WeightVersion | None = None) -> bool:
        """Ends the transaction and moves the version; see `LLMEngine.finish_weight_update`.

        Returns:
            Whether the update was applied (False: it ended unapplied after a refusal).
        """
        self._start()
        try:
            async with self._update_calls, self._at_step_boundary():
                with self.stats.counting_update_failures():
                    applied = self._weights.finish(weight_version)
                if applied:
                    self.stats.weight_updates += 1
                return applied
        finally:
            self._notify()

    async def abort_weight_update(self) -> bool:
        """Ends the transaction on purpose; see `LLMEngine.abort_weight_update`."""
        self._start()
        async with self._update_calls, self._at_step_boundary():
            aborted = self._weights.abort()
        self._notify()
        return aborted

    @property
    def last_adapter_commit(self) -> AdapterCommit | None:
        """What the last finish of an adapter's update did; see `LLMEngine`'s."""
        return self._weights.last_adapter_commit

    def check_finish_weight_update(self, weight_version: WeightVersion | None = None) -> None:
        """Raises what `finish_weight_update` would raise now; see `LLMEngine`'s."""
        self._weights.check_finish(weight_version)

    @property
    def weight_update(self) -> WeightUpdateStatus | None:
        """The weight update in progress, or None; see `LLMEngine.weight_update`."""
        return self._weights.status()

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        """Relabels the current weights; see `LLMEngine.update_weight_version`."""
        async with self._update_calls, self._at_step_boundary():
            self._weights.relabel(new_version)

    async def reset_weights(self) -> None:
        """Writes zeros over every weight; see `LLMEngine.reset_weights`."""
        self._start()
        async with self._update_calls, self._at_step_boundary():
            self.engine.reset_weights()

    async def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of every weight, by name, computed off the event loop (no step runs meanwhile).

        Raises:
            EngineStateError: A weight update is in progress or weights are torn.
        """
        self._start()
        async with self._at_step_boundary():
            return await asyncio.to_thread(self.engine.weight_checksums)

    async def shutdown_weight_transfer_engine(self) -> None:
        """Leaves the trainer's transfer; see `LLMEngine.shutdown_weight_transfer_engine`."""
        self._start()
        async with self._update_calls, self._transfer_lock, self._at_step_boundary():
            await asyncio.to_thread(self._weights.release_transfer_engine)

    # --- lifecycle ----------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stops the loop, fails open streams, and releases threads and the transfer engine."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:  # it ends after the step in flight
            await asyncio.to_thread(self._thread.join)
        for queue in self._streams.values():
            queue.put_nowait(_Closed())
        self._step_done.set()  # a draining `wait` pause waits on it: it now fails instead
        self._settle_idle_waiters(EngineStateError("the engine was shut down"))
        # A transfer call still waiting in torch holds the transfer engine until its timeout_s;
        # shutting it down waits for that, off the event loop (a caller may bound it).
        await _on_transfer_thread(self.engine.shutdown)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()
