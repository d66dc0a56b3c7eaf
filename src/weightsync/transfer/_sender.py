"""What every backend's sender shares: the check of a trainer's tensors against the announcement."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec


class AnnouncedTensors:
    """A trainer's `(name, tensor)` iterator, checked tensor by tensor against what was announced.

    Sending a tensor the receivers do not expect would hang a collective or load garbage, so
    every backend's sender takes its tensors through this check and stops at the first
    divergence, naming it.

    Args:
        pairs: The trainer's iterator, e.g. `iter(model.named_parameters())`.
        post: Optional map from each pair to the tensor to send (e.g. a gather).
    """

    def __init__(
        self,
        pairs: Iterator[tuple[str, torch.Tensor]],
        post: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None,
    ) -> None:
        self._pairs = pairs
        self._post = post

    def take(self, spec: TensorSpec, index: int) -> torch.Tensor:
        """Returns the next tensor, which must be announced tensor `index`, matching `spec`.

        Raises:
            WeightValidationError: The iterator ended, or the name, shape or dtype differs.
        """
        pair = next(self._pairs, None)
        if pair is None:
            raise WeightValidationError(
                f"the iterator ended after {index} tensors but the update announced more, "
                f"starting with {spec.name!r}"
            )
        name, tensor = pair
        if self._post is not None:
            tensor = self._post(pair)
        if name != spec.name:
            raise WeightValidationError(
                f"tensor #{index} is {name!r} but the update announced {spec.name!r}"
            )
        got = TensorSpec.of(name, tensor)
        if got.shape != spec.shape or got.dtype != spec.dtype:
            raise WeightValidationError(
                f"tensor {name!r} is {got.describe()} but the update announced {spec.describe()}"
            )
        return tensor

    def check_exhausted(self, count: int) -> None:
        """Checks that the iterator yields nothing after the `count` announced tensors.

        Raises:
            WeightValidationError: It yields more, naming the first extra tensor.
        """
        extra = next(self._pairs, None)
        if extra is not None:
            raise WeightValidationError(
                f"the iterator yields more tensors than the {count} announced, "
                f"starting with {extra[0]!r}"
            )
