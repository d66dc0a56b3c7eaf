"""A linear layer that multiplies by a prepacked copy of its weight, where that is faster.

oneDNN (in torch's CPU wheels) lays a weight matrix out in blocks that its matmul reads faster
than the plain row-major weight: on a CPU in float32, 1.6x a decoder layer at 8 tokens and 1.2x
at 64 (`benchmarks/bench_linear.py`), equal within float32 rounding. The copy is built once and
read with plain input and output tensors, so a call converts nothing. The plain weight stays
the parameter (what updates write into); `LlamaForCausalLM.repack_linears` rebuilds the copies.

`PackedCopies` rebuilds them off the path of whoever wrote the weights: a linear whose weight
changed drops its copy at once (it reads its plain weight, correct at once), and a thread builds
the new copy and swaps it in, unless the weights may have changed again since it began.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["PackedCopies", "PackedLinear", "pack_weight", "packing_unavailable"]

logger = logging.getLogger(__name__)


def packing_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why linears on `device` in `dtype` cannot use prepacked weights; None when they can.

    Measured to win only on a CPU in float32 (`benchmarks/bench_linear.py`); the ops come with
    torch's CPU wheels built with oneDNN, and a build without them falls back to plain weights.
    """
    if device.type != "cpu" or dtype != torch.float32:
        return (
            f"only float32 on a CPU is packed, not {str(dtype).removeprefix('torch.')} on {device}"
        )
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    try:
        probe = torch.ones(1, 1)
        torch.ops.mkldnn._linear_pointwise(probe, pack_weight(probe), None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError) as exc:  # an op missing or refusing
        return f"oneDNN's prepacked linear is unavailable ({type(exc).__name__}: {exc})"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A new oneDNN copy of `weight` (out_features, in_features) in the layout its matmul reads."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return packed


class PackedLinear(nn.Linear):
    """`nn.Linear` that multiplies by a prepacked copy of its weight when it holds one.

    `packed` is oneDNN's blocked copy of `weight` (None: none, the plain weight is read). The
    plain weight stays the one updates write into; the copy is rebuilt from it by
    `LlamaForCausalLM.repack_linears`, and read with plain input and output tensors, so a call
    converts nothing. The bias is always read live.
    """

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T + bias` for `x` (tokens, in_features), from the packed copy if any."""
        packed = self.packed  # read once: a repack swaps the attribute, never its contents
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return out


class PackedCopies:
    """The packed copies of a model's linears: built now, or rebuilt on a thread of their own.

    A build reads the plain weights and installs every copy it made at once, and only if no
    `cancel` came since it began: the call that comes before the plain weights change. A
    rebuild that may have read old or half-written weights is so discarded, never installed,
    and no forward pass multiplies by a copy older than the weights.

    Args:
        linears: The linears whose copies this keeps.
    """

    def __init__(self, linears: Sequence[PackedLinear]) -> None:
        self._linears = list(linears)
        self._changed = threading.Condition()  # guards the counters below and every install
        self._generation = 0  # moves at every `cancel`: a build of an older one is discarded
        self._rebuilds = 0  # rebuild threads still running

    def build(self, linears: Sequence[PackedLinear]) -> None:
        """Rebuilds the copies of `linears` on this thread; a rebuild in flight is discarded.

        If building one fails (out of memory), `linears` drop their copies and read their
        plain weights, which is slower but never stale, and the failure is logged.
        """
        self._build(linears, self.cancel(), torch.get_num_threads())

    def rebuild_later(self, stale: Sequence[PackedLinear]) -> None:
        """Drops the copies of `stale` now and rebuilds every missing copy on a thread.

        The linears read their plain weights until the new copies are swapped in, together.
        Returns at once: the caller (a weight update's commit) does not pay for the rebuild.
        """
        dropped: list[torch.Tensor | None] = []
        with self._changed:  # against an install: a rebuild in flight is superseded by this one
            self._generation += 1
            generation = self._generation
            for linear in stale:
                dropped.append(linear.packed)
                linear.packed = None
            missing = [linear for linear in self._linears if linear.packed is None]
            if not missing:
                return
            self._rebuilds += 1
        # The thread frees the stale copies before building: the memory is reused, and
        # freeing tens of megabytes is off the caller's path too. Not a daemon: the
        # interpreter's exit waits for it (one rebuild, bounded), where a daemon thread coming
        # back from a torch call into a finalizing interpreter ends the process in
        # std::terminate (exit status 134).
        rebuild = threading.Thread(
            target=self._rebuild,
            args=(missing, generation, torch.get_num_threads(), dropped),
            name="repack-linears",
            daemon=False,  # not inherited: a commit may run on a transfer's daemon thread
        )
        try:
            rebuild.start()
        except RuntimeError as exc:  # no thread to be had: the plain weights serve, correct
            with self._changed:
                self._rebuilds -= 1
                self._changed.notify_all()
            logger.warning("rebuilding %d packed copies failed to start: %s", len(missing), exc)

    def cancel(self) -> int:
        """Discards every build in flight: the plain weights are about to change.

        Returns:
            The new generation, which a build begun after this call carries.
        """
        with self._changed:
            self._generation += 1
            return self._generation

    def wait(self, timeout_s: float) -> bool:
        """Waits until no rebuild thread runs, at most `timeout_s` seconds; whether none does."""
        with self._changed:
            return self._changed.wait_for(lambda: self._rebuilds == 0, timeout=timeout_s)

    def _rebuild(
        self,
        linears: list[PackedLinear],
        generation: int,
        num_threads: int,
        dropped: list[torch.Tensor | None],
    ) -> None:
        try:
            dropped.clear()
            self._build(linears, generation, num_threads)
        finally:
            with self._changed:
                self._rebuilds -= 1
                self._changed.notify_all()

    def _build(self, linears: Sequence[PackedLinear], generation: int, num_threads: int) -> None:
        # oneDNN runs on OpenMP, whose thread count is per calling thread: a thread other than
        # the one that called torch.set_num_threads (a transfer's worker, this rebuild) would
        # pack on every core, several times slower on a busy machine. Pin it to the caller's.
        torch.set_num_threads(num_threads)
        copies = []
        try:
            for linear in linears:
                if self._generation != generation:
                    return  # cancelled: the weights moved on; stop burning the update's CPU
                copies.append(pack_weight(linear.weight))
        except (RuntimeError, MemoryError) as exc:
            with self._changed:
                if self._generation == generation:
                    for linear in linears:
                        linear.packed = None
            logger.warning(
                "packing %d linears failed (%s: %s): they read their plain weights",
                len(linears), type(exc).__name__, exc,
            )  # fmt: skip
            return
        with self._changed:
            if self._generation != generation:
                return  # the weights may have changed while they were read: never installed
            for linear, copy in zip(linears, copies, strict=True):
                linear.packed = copy  # one attribute: a forward pass reads it once per call
