"""The store of a weight-transfer group, as its ranks use it: JSON values, every read bounded.

The trainer hosts a `TCPStore` beside its group; every rank sends small control messages through
it (the wire parameters, rank claims, the update handshake, the reasons a rank gave up).
`GroupStore` is that conversation: a read waits `timeout_s` at most, even when the store's
host is stopped with its socket open, and torch's failures come out as weightsync's errors.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError

__all__ = ["GroupStore", "torch_message", "translate"]

_T = TypeVar("_T")
# A store read gets its own limit plus this, so that torch's own timeout, when it has one, and
# its clearer message come first.
_STORE_GRACE_S = 1.0


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
        self._call(
            f"writing {key!r} to the transfer store",
            lambda: self._store.set(key, json.dumps(value)),
        )

    def _read(self, what: str, fn: Callable[[], _T], limit_s: float) -> _T:
        """Runs a store read on a daemon thread, `limit_s` at most.

        torch's store client waits for an answer without a bound: a trainer that is stopped
        (SIGSTOP, a debugger) but whose socket is open would hang it forever. A read that timed
        out leaves the client mid-conversation, so the store is not read again.
        """
        if self._store_stuck:
            raise WeightTransferTimeout(
                f"{what}: the transfer store stopped answering earlier (timeout_s): its host is "
                "stopped or stuck"
            )
        result: Future[_T] = Future()

        def run() -> None:
            try:
                result.set_result(self._call(what, fn))
            except BaseException as exc:  # handed to the waiting thread
                result.set_exception(exc)

        threading.Thread(target=run, name="weightsync-store", daemon=True).start()
        try:
            return result.result(limit_s + _STORE_GRACE_S)
        except FutureTimeout:
            self._store_stuck = True
            raise WeightTransferTimeout(
                f"{what} timed out after {limit_s:g} s (timeout_s): the store's host (the "
                "trainer) does not answer: stopped, stuck or unreachable"
            ) from None

    def get(self, key: str, timeout_s: float | None = None) -> Any:
        """Reads the value under `key`, waiting up to `timeout_s` (default: the group's)."""
        limit = self.timeout_s if timeout_s is None else timeout_s

        def read() -> Any:
            self._store.wait([key], datetime.timedelta(seconds=limit))
            return json.loads(self._store.get(key))

        return self._read(f"reading {key!r} from the transfer store", read, limit)

    def lookup(self, key: str) -> Any:
        """Returns the value under `key`, or None when there is none yet; never waits for one.

        Raises:
            WeightTransferError: The store cannot be read (its host, the trainer, is gone).
            WeightTransferTimeout: The store did not answer within the group's timeout.
        """

        def read() -> Any:
            if not self._store.check([key]):
                return None
            return json.loads(self._store.get(key))

        return self._read(f"reading {key!r} from the transfer store", read, self.timeout_s)

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
            return json.loads(self._store.compare_set(key, "", text))

        return self._read(f"writing {key!r} to the transfer store", swap, self.timeout_s)

    def delete(self, key: str) -> None:
        """Removes `key` from the store (nothing happens when it is not there)."""
        self._call(f"deleting {key!r} from the transfer store", lambda: self._store.delete_key(key))

    def has(self, keys: list[str]) -> bool:
        """Whether every key is in the store (the trainer's: it hosts the store, so this is local)."""
        return bool(self._call("checking the transfer store", lambda: self._store.check(keys)))

    def claim_rank(self, claimant: str) -> None:
        """Registers this rank in the store for `claimant`; another claimant is refused.

        The same claimant (an engine retrying its own join after a timeout) may claim again.
        """
        key = f"rank/{self.rank}"
        owner = self._read(
            "claiming a rank", lambda: self._store.compare_set(key, "", claimant), self.timeout_s
        )
        if owner.decode() != claimant:
            raise WeightValidationError(
                f"rank {self.rank} was claimed by another process already: each worker needs a "
                "distinct worker_index (rank = rank_offset + worker_index)"
            )

    def append(self, key: str, value: Any) -> None:
        """Appends a JSON-safe value to the list under `key` (one store call, however many)."""
        line = json.dumps(value) + "\n"
        self._call(
            f"appending to {key!r} in the transfer store", lambda: self._store.append(key, line)
        )

    def read_list(self, key: str, limit_s: float) -> list[Any]:
        """The values appended under `key` (none if the store has none or does not answer)."""

        def read() -> list[Any]:
            if not self._store.check([key]):
                return []
            text = bytes(self._store.get(key)).decode("utf-8", "replace")
            values = []
            for line in text.splitlines():
                with contextlib.suppress(ValueError):
                    values.append(json.loads(line))
            return values

        try:
            return self._read(f"reading {key!r}", read, limit_s)
        except Exception:  # a dead or stopped store: nothing to read
            return []
