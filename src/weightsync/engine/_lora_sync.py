"""A LoRA adapter's live updates, as the engine's adapters take them: specs, commit, versions.

`LiveWeights` runs an adapter's update transaction (see its `start(lora_name=...)`); this is the
other side, `AdapterSink`, over the engine's `LoRARegistry`:

- what an update must bring: the PEFT-named tensors of the loaded version, or of the adapter a
  PEFT config describes;
- the commit: the landed tensors become the adapter's next version through the registry (and so
  through `build_lora_adapter`, the one validation path), under the engine's lock, so that no
  request is added between the swap and the count of versions in use;
- the limit of versions kept per adapter: beyond `max_versions`, the oldest versions requests
  still run with are dropped and those requests aborted.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightsync.engine._sequence import Sequence
from weightsync.engine.lora import (
    _MODULES,
    _PEFT_PREFIX,
    LoRAAdapter,
    LoRARegistry,
    _check_config,
    _fail,
    _module_shapes,
)
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.weights import AdapterCommit
from weightsync.transfer.base import TensorSpec

__all__ = ["AdapterVersions"]

logger = logging.getLogger(__name__)


def _peft_name(layer: int, module: str, kind: str) -> str:
    """PEFT's name of a tensor: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"{_PEFT_PREFIX}model.layers.{layer}.{_MODULES[module][1]}.{module}.lora_{kind}.weight"


def _specs_of(adapter: LoRAAdapter) -> dict[str, TensorSpec]:
    """The PEFT-named specs of a loaded adapter's tensors."""
    specs = {}
    for (layer, module), pair in adapter.weights.items():
        for kind, tensor in zip("AB", pair, strict=True):
            name = _peft_name(layer, module, kind)
            specs[name] = TensorSpec.of(name, tensor)
    return specs


def _alpha_for(scaling: float, rank: int) -> float:
    """A `lora_alpha` whose `lora_alpha / rank` is exactly `scaling` (as the builder computes).

    A loaded adapter keeps its scaling, not its config; its next version is built from a config
    that must give the very same scaling, or its tokens would drift by a rounding.
    """
    alpha = scaling * rank
    for _ in range(4):  # a product and a quotient round once each: a step or two fixes it
        if alpha / rank == scaling:
            return alpha
        alpha = math.nextafter(alpha, math.inf if alpha / rank < scaling else -math.inf)
    return scaling * rank


class AdapterVersions:
    """The engine's adapters as live updates see them (`weightsync.engine.weights.AdapterSink`).

    Args:
        registry: The engine's adapters.
        max_versions: Most versions of one adapter kept at once (the current one and those
            requests run with).
        lock: The engine's request lock: held while a commit swaps the version and counts those
            in use, so that no request takes a version meanwhile.
        unfinished: The engine's unfinished sequences (queued, waiting, running), under `lock`.
        abort: Aborts requests by id, as `LLMEngine.abort_request` does (outside `lock`).
    """

    def __init__(
        self,
        registry: LoRARegistry,
        *,
        max_versions: int,
        lock: threading.Lock,
        unfinished: Callable[[], Iterable[Sequence]],
        abort: Callable[[set[str]], None],
    ) -> None:
        self.registry = registry
        self.max_versions = max_versions
        self._lock = lock
        self._unfinished = unfinished
        self._abort = abort
        # (lora_int_id, version) of the version an update without a config started from (one
        # update at a time): its tensors are shaped and scaled for it, so it alone may take
        # them. Ids are never reused: the pair names one version without holding its tensors.
        self._updating: tuple[int, int] | None = None

    def adapter_specs(
        self, lora_name: str, lora_config: Mapping[str, Any] | None
    ) -> dict[str, TensorSpec]:
        """The tensors an update of `lora_name` must bring (see `AdapterSink.adapter_specs`)."""
        if lora_config is None:
            adapter = self.registry.get(lora_name)
            self._updating = (adapter.lora_int_id, adapter.version)
            return _specs_of(adapter)
        self.registry.check_can_load(lora_name, load_inplace=True)  # the name it will commit
        where = f"{lora_name!r} (lora_config)"
        rank, _ = _check_config(lora_config, where, self.registry.max_rank)
        targets = lora_config.get("target_modules")
        if not isinstance(targets, list) or not targets:
            raise _fail(
                where,
                f"target_modules must list the modules the update brings (e.g. "
                f'["q_proj", "v_proj"]), got {targets!r:.80}: a pattern does not say which '
                "tensors to expect",
            )
        if lora_config.get("layers_to_transform") is not None:
            raise _fail(where, "layers_to_transform is not served: adapt every layer")
        shapes = _module_shapes(self.registry.model_config)
        specs = {}
        for layer in range(self.registry.model_config.num_hidden_layers):
            for module in targets:
                shape = shapes[module]
                for kind, dims in (
                    ("A", (rank, shape.in_features)),
                    ("B", (shape.out_features, rank)),
                ):
                    name = _peft_name(layer, module, kind)
                    specs[name] = TensorSpec(name, self.registry.dtype, dims)
        return specs

    def commit_adapter(
        self,
        lora_name: str,
        tensors: dict[str, torch.Tensor],
        lora_config: Mapping[str, Any] | None,
        weight_version: WeightVersion | None,
    ) -> AdapterCommit:
        """Makes `tensors` the adapter's next version; drops the versions beyond the limit."""
        config = lora_config if lora_config is not None else self._config_of(lora_name)
        with self._lock:
            adapter = self.registry.add(
                lora_name, tensors, config, load_inplace=True, label=weight_version
            )
            # The versions in use: the new one, and those unfinished requests run with.
            users: dict[int, list[str]] = {adapter.version: []}
            kept: dict[int, LoRAAdapter] = {adapter.version: adapter}
            for seq in self._unfinished():
                lora = seq.lora
                if lora is not None and lora.lora_int_id == adapter.lora_int_id:
                    users.setdefault(lora.version, []).append(seq.request_id)
                    kept[lora.version] = lora
        dropped = sorted(kept)[: max(0, len(kept) - self.max_versions)]
        ended = {request_id for version in dropped for request_id in users[version]}
        if ended:
            self._abort(ended)
            logger.warning(
                "LoRA adapter %r: versions %s dropped to keep %d; %d requests running with them "
                "end as aborted", lora_name, [kept[v].weight_version for v in dropped],
                self.max_versions, len(ended),
            )  # fmt: skip
        return AdapterCommit(
            lora_name, adapter.weight_version, [kept[v].weight_version for v in dropped]
        )

    def _config_of(self, lora_name: str) -> dict[str, Any]:
        """The PEFT config that builds the next version of the adapter the update started from.

        Raises:
            LoRAAdapterError: The adapter was loaded anew (or unloaded and loaded again) while
                the update was open: its scaling or modules may differ from the update's.
        """
        adapter = self.registry.get(lora_name)
        if (adapter.lora_int_id, adapter.version) != self._updating:
            raise _fail(
                repr(lora_name),
                f"loaded anew while its update was open (load_lora_adapter; version "
                f"{adapter.weight_version!r} now): the update, shaped and scaled for the version "
                "it started from, ends unapplied; send it again",
            )
        return {
            "r": adapter.rank,
            "lora_alpha": _alpha_for(adapter.scaling, adapter.rank),
            "target_modules": sorted({module for _, module in adapter.weights}),
            "base_model_name_or_path": adapter.base_model_name_or_path,
        }
