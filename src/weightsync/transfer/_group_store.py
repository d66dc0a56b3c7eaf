"""The store of a weight-transfer group, as its ranks use it: JSON values, every call bounded.

The trainer hosts a `TCPStore` beside its group; every rank sends small control messages through
it (the wire parameters, rank claims, the update handshake, the reasons a rank gave up).
`GroupStore` is that conversation: every call, a write as much as a read, returns within
`timeout_s` even when the store's host is stopped with its socket open; every value read is
checked (its size, then its JSON) before anyone uses it, since any process that reaches the
store's port can write into it; and torch's failures come out as weightsync's errors, naming
the store and the key.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError

__all__ = ["GroupStore", "torch_message", "translate"]

_T = TypeVar("_T")
# A store call gets its own limit plus this, so that torch's own timeout, when it has one, and
# its clearer message come first.
_STORE_GRACE_S = 1.0

MAX_VALUE_BYTES = 1 << 20
"""The largest value a rank takes from the store (1 MiB); a larger one is malformed.

The largest a weightsync rank writes is a few refusals of `REASON_CHARS` each (a worker's
kept refusals); a value beyond this was written by something else and is never parsed.
"""
MAX_LIST_BYTES = 4 << 20
"""The largest appended list read (`read_list`); what lies beyond it is not read."""


def _is_timeout(exc: BaseException) -> bool:
    # torch reports a collective's or the store's timeout as a RuntimeError (DistError) saying so;
    # any other exception type that mentions a timeout (a constructor's TypeError naming its
    # `timeout` argument, say) is a failure, not a timeout.
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def torch_message(exc: BaseException) -> str:
    """The first line of a torch failure's message: what torch appends below it is C++ frames.

    The exception itself (chained as the cause of weightsync's error) keeps them, for a debug log.
    """
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def translate(what: str, exc: Exception, timeout_s: float) -> WeightTransferError:
    """Maps a torch.distributed failure onto weightsync's error classes (one line, no C++ frames)."""
    if _is_timeout(exc):
        return WeightTransferTimeout(
            f"{what} timed out after {timeout_s:g} s (timeout_s): a peer is missing, stuck or "
            f"was never told to take part; {type(exc).__name__}: {torch_message(exc)}"
        )
    return WeightTransferError(
        f"{what} failed, most likely because a peer process died or closed the group; "
        f"{type(exc).__name__}: {torch_message(exc)}"
    )


class GroupStore:
    """A rank's end of its group's store; `BroadcastGroup` is one.

    Attributes:
        rank: This rank; 0 is the trainer, which hosts the store.
        timeout_s: Limit of every read, in seconds.
    """

    rank: int
    timeout_s: float
    where: str
    """The store, for messages: `"the transfer store at HOST:PORT"`."""
    _store: Any
    _store_stuck: bool

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except WeightTransferError:
            raise
        except Exception as exc:
            raise translate(what, exc, self.timeout_s) from exc

    def set(self, key: str, value: Any) -> None:
        """Publishes a JSON-safe value under `key` in the group's store."""
        text = json.dumps(value)
        self._bounded(
            f"writing {key!r} to {self.where}", lambda: self._store.set(key, text), self.timeout_s
        )

    def _bounded(self, what: str, fn: Callable[[], _T], limit_s: float) -> _T:
        """Runs a store call on a daemon thread, `limit_s` at most.

        torch's store client waits for its host without a bound, in a write as in a read, and a
        call waits for the one before it on the same connection: a trainer that is stopped
        (SIGSTOP, a debugger) but whose socket is open would hang it forever. A call that timed
        out leaves the client mid-conversation, so the store is not called again: every later
        call fails at once.
        """
        if self._store_stuck:
            raise WeightTransferTimeout(
                f"{what}: {self.where} stopped answering earlier (timeout_s): its host (the "
                "trainer) is stopped or stuck"
            )
        box: list[tuple[bool, Any]] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append((True, self._call(what, fn)))
            except WeightTransferError as exc:
                # Handed over as a fresh error: this one's chain holds torch's, whose frames
                # hold this thread's and the group, which a caller keeping the error (or a
                # cycle through it) would keep, with the store's socket.
                box.append((False, type(exc)(str(exc))))
            except BaseException as exc:  # handed to the waiting thread
                box.append((False, exc.with_traceback(None)))
            done.set()

        threading.Thread(target=run, name="weightsync-store", daemon=True).start()
        if not done.wait(limit_s + _STORE_GRACE_S):
            self._store_stuck = True
            raise WeightTransferTimeout(
                f"{what} timed out after {limit_s:g} s (timeout_s): the store's host (the "
                "trainer) does not answer: stopped, stuck or unreachable"
            )
        ok, value = box.pop()
        if ok:
            return value  # type: ignore[no-any-return]
        try:
            raise value
        finally:
            del value  # this frame is in the error's traceback: no cycle through it

    def _value(self, key: str, raw: object) -> Any:
        """The JSON value stored under `key`, checked before use.

        Raises:
            WeightTransferError: The value is larger than `MAX_VALUE_BYTES`, or not JSON (not
                UTF-8, not parseable, nested too deep); the message names the store and the key.
        """
        data = bytes(raw)  # type: ignore[call-overload]
        if len(data) > MAX_VALUE_BYTES:
            raise self.malformed(key, f"{len(data)} bytes, more than {MAX_VALUE_BYTES}")
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise self.malformed(key, f"not JSON: {type(exc).__name__}: {str(exc)[:100]}") from None

    def malformed(self, key: str, detail: str) -> WeightTransferError:
        """The error for a value under `key` that no weightsync rank wrote."""
        return WeightTransferError(
            f"{self.where} holds a malformed value under {key!r} ({detail}): it was not written "
            "by a weightsync rank of this group; another process writes into the store, so "
            "keep its port reachable by the group's ranks only"
        )

    def get(self, key: str, timeout_s: float | None = None) -> Any:
        """Reads the value under `key`, waiting up to `timeout_s` (default: the group's)."""
        limit = self.timeout_s if timeout_s is None else timeout_s

        def read() -> Any:
            self._store.wait([key], datetime.timedelta(seconds=limit))
            return self._store.get(key)

        raw = self._bounded(f"reading {key!r} from {self.where}", read, limit)
        return self._value(key, raw)

    def lookup(self, key: str) -> Any:
        """Returns the value under `key`, or None when there is none yet; never waits for one.

        Raises:
            WeightTransferError: The store cannot be read (its host, the trainer, is gone).
            WeightTransferTimeout: The store did not answer within the group's timeout.
        """

        def read() -> Any:
            return self._store.get(key) if self._store.check([key]) else None

        raw = self._bounded(f"reading {key!r} from {self.where}", read, self.timeout_s)
        return None if raw is None else self._value(key, raw)

    def try_get(self, key: str) -> Any:
        """Returns the value under `key` if present and the store answers in time, else None."""
        try:
            return self.lookup(key)
        except Exception:  # a dead or stopped trainer takes the store with it: nothing to read
            return None

    def set_once(self, key: str, value: Any) -> Any:
        """Stores `value` under `key` unless a value is there already; returns the one stored.

        Two ranks racing to answer for the same key thus agree on one answer.
        """
        text = json.dumps(value)

        def swap() -> Any:
            return self._store.compare_set(key, "", text)

        raw = self._bounded(f"writing {key!r} to {self.where}", swap, self.timeout_s)
        return self._value(key, raw)

    def delete(self, key: str) -> None:
        """Removes `key` from the store (nothing happens when it is not there)."""
        self._bounded(
            f"deleting {key!r} from {self.where}",
            lambda: self._store.delete_key(key),
            self.timeout_s,
        )

    def has(self, keys: list[str]) -> bool:
        """Whether every key is in the store."""
        return bool(
            self._bounded(f"checking {self.where}", lambda: self._store.check(keys), self.timeout_s)
        )

    def claim_rank(self, claimant: str) -> None:
        """Registers this rank in the store for `claimant`; another claimant is refused.

        The same claimant (an engine retrying its own join after a timeout) may claim again.
        """
        key = f"rank/{self.rank}"
        owner = self._bounded(
            f"claiming {key!r} in {self.where}",
            lambda: self._store.compare_set(key, "", claimant),
            self.timeout_s,
        )
        if bytes(owner) != claimant.encode():  # the owner's id, or whatever else is there
            raise WeightValidationError(
                f"rank {self.rank} was claimed by another process already ({key!r} in "
                f"{self.where}): each worker needs a distinct worker_index (rank = rank_offset + "
                "worker_index)"
            )

    def append(self, key: str, value: Any) -> None:
        """Appends a JSON-safe value to the list under `key` (one store call, however many)."""
        line = json.dumps(value) + "\n"
        self._bounded(
            f"appending to {key!r} in {self.where}",
            lambda: self._store.append(key, line),
            self.timeout_s,
        )

    def read_list(self, key: str, limit_s: float) -> list[Any]:
        """The values appended under `key` (none if the store has none or does not answer)."""

        def read() -> list[Any]:
            if not self._store.check([key]):
                return []
            # Bounded before parsing: only what fits in MAX_LIST_BYTES is read, line by line.
            text = bytes(self._store.get(key))[:MAX_LIST_BYTES].decode("utf-8", "replace")
            values = []
            for line in text.splitlines():
                with contextlib.suppress(ValueError, RecursionError):
                    values.append(json.loads(line))
            return values

        try:
            return self._bounded(f"reading {key!r} from {self.where}", read, limit_s)
        except Exception:  # a dead or stopped store: nothing to read
            return []
