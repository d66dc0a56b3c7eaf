"""The `disk` backend: the trainer writes a safetensors checkpoint directory, the server loads it.

The update info names the directory, as in vLLM's draft `disk` backend: `{"path": DIR}`. Every
header is checked against the model before any data is read, straight into the weights: reads, not
a memory map, since a mapped file that shrinks kills the reader (SIGBUS) where a read fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer._safetensors import (
    INDEX_FILE,
    SafetensorsEntry,
    open_regular,
    read_header,
    read_index,
    read_tensor,
    write_safetensors,
)
from weightsync.transfer.base import (
    LoadWeightsFn,
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    _parse_info,
    _validate_specs,
    dtype_name,
)

__all__ = [
    "DiskWeightTransferEngine",
    "DiskWeightTransferInitInfo",
    "DiskWeightTransferUpdateInfo",
    "WeightDir",
    "save_weight_dir",
]

logger = logging.getLogger(__name__)


@dataclass
class DiskWeightTransferInitInfo(WeightTransferInitInfo):
    """The `disk` backend joins nothing: its init info is `{}`, and optional."""


@dataclass
class WeightDir:
    """The wire form of a `disk` update info (also prime-rl's `{"weight_dir": DIR}`)."""

    path: str
    weight_version: str | int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON form: `{"path": DIR}`, and `weight_version` when set."""
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass
class DiskWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """A checkpoint directory, with what its safetensors headers say it holds.

    Build it with [`from_directory`][weightsync.transfer.disk.DiskWeightTransferUpdateInfo.from_directory];
    over the wire it is `{"path": DIR}` (plus an optional `weight_version`): `names`, `dtype_names`
    and `shapes` are read from the files' headers, not sent.

    Attributes:
        path: The directory, absolute.
    """

    path: str = ""
    _entries: list[tuple[str, SafetensorsEntry]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @classmethod
    def from_directory(
        cls, path: str | os.PathLike[str], *, weight_version: str | int | None = None
    ) -> DiskWeightTransferUpdateInfo:
        """Reads and checks the headers of the checkpoint in `path`; no tensor data is read.

        The files are those `model.safetensors.index.json` maps names to (each name in its file),
        else every `*.safetensors` file of the directory; no name may be in two files.

        Raises:
            WeightValidationError: Not a directory, no safetensors file, a malformed header, a
                name in two files, or an index that disagrees with the files (named, with a fix).
        """
        if not isinstance(path, str | os.PathLike) or not str(path):
            raise WeightValidationError(f"path must name a checkpoint directory, got {path!r:.80}")
        directory = Path(path).absolute()
        if not os.path.isdir(directory):  # False, not OSError, for a name too long, say
            raise WeightValidationError(
                f"path {str(directory)!r}: not a directory visible to this server; the trainer "
                "must write the checkpoint to storage the server reads at the same path"
            )
        files, index = _checkpoint_files(directory)
        found: dict[str, tuple[str, SafetensorsEntry]] = {}  # name -> (file, entry), data order
        for file in files:
            for entry in read_header(directory / file):
                name = entry.spec.name
                if name in found:
                    raise WeightValidationError(
                        f"{directory}: tensor {name!r} is in both {found[name][0]} and {file}"
                    )
                if index is not None and index.get(name) != file:
                    raise WeightValidationError(
                        f"{directory / INDEX_FILE}: maps {name!r} to {index.get(name)!r}, but it is "
                        f"in {file}"
                    )
                found[name] = (file, entry)
        missing = sorted(index.keys() - found.keys()) if index is not None else []
        if missing:
            raise WeightValidationError(
                f"{directory / INDEX_FILE}: lists {len(missing)} tensors no file holds, e.g. "
                f"{missing[:3]}"
            )
        specs = [entry.spec for _, entry in found.values()]
        info = cls(
            names=[s.name for s in specs],
            dtype_names=[dtype_name(s.dtype) for s in specs],
            shapes=[list(s.shape) for s in specs],
            weight_version=weight_version,
            path=str(directory),
        )
        info._entries = list(found.values())
        return info

    def to_dict(self) -> dict[str, Any]:
        """Returns the wire form: `{"path": ...}` and the version label, if any."""
        return WeightDir(self.path, self.weight_version).to_dict()


def _checkpoint_files(directory: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read, and the index's name -> file map (None without an index)."""
    index = read_index(directory)
    if index is not None:
        return sorted(set(index.values())), index
    files = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise WeightValidationError(
            f"{directory}: no *.safetensors file; write the weights in safetensors format "
            "(save_weight_dir, or save_pretrained(safe_serialization=True))"
        )
    return files, None


class DiskWeightTransferEngine(WeightTransferEngine):
    """Receiver of the `disk` backend: loads a checkpoint directory into the model.

    Nothing to join: `init_transfer_engine` takes `{}` and is optional. Each update info names a
    directory holding every weight of the model (a checkpoint, not a patch; a transaction may load
    several), checked with its names, dtypes and shapes before any data is read.

    Args:
        worker_index: This worker's index (unused: every worker reads the same directory).
        expected_specs: What the model holds, by name; the headers are checked against it.
        params: The model's weights by name; a contiguous CPU tensor among them is read into in
            place (give the fused weights' row views too, as `named_weights()` yields them), the
            others go through `load_weights`.
    """

    init_info_cls = DiskWeightTransferInitInfo
    update_info_cls = DiskWeightTransferUpdateInfo
    needs_init: ClassVar[bool] = False
    _shut_down = False  # set by shutdown, cleared by init_transfer_engine

    @property
    def is_initialized(self) -> bool:
        """True until `shutdown`: reading a directory needs no group."""
        return not self._shut_down

    def init_transfer_engine(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> None:
        """Checks that `init_info` is empty (`{}`); there is nothing to join."""
        self.parse_init_info(init_info)
        self._shut_down = False

    def parse_update_info(
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo | WeightDir
    ) -> DiskWeightTransferUpdateInfo:
        """Parses `{"path": DIR}` and reads the headers of the directory's files.

        Raises:
            WeightValidationError: Unknown keys, or not a checkpoint (see `from_directory`).
        """
        if isinstance(update_info, DiskWeightTransferUpdateInfo):
            if update_info._entries:  # read by from_directory: the headers are known
                return update_info
            # Built by hand: read the files, not its lists (a null path is named, not dropped).
            update_info = WeightDir(update_info.path, update_info.weight_version)
        request = _parse_info(WeightDir, update_info, what="update_info")
        return DiskWeightTransferUpdateInfo.from_directory(
            request.path, weight_version=request.weight_version
        )

    def check_update(self, update_info: WeightTransferUpdateInfo) -> list[TensorSpec]:
        """The checkpoint's specs, without what the model derives, checked against the model.

        Raises:
            WeightValidationError: A name the model lacks, another dtype or shape, or a weight
                of the model the directory lacks.
        """
        expected = self.expected_specs
        if expected is None:
            return update_info.specs()
        # Skipped as the loader skips them: the model derives a tied `lm_head.weight` and the
        # rotary frequencies that older checkpoints saved.
        specs = [
            s
            for s in update_info.specs()
            if s.name in expected
            or not (s.name == "lm_head.weight" or s.name.endswith("rotary_emb.inv_freq"))
        ]
        missing = sorted(expected.keys() - {s.name for s in specs})
        if missing:
            raise WeightValidationError(
                f"update rejected before any byte moved: the directory lacks {len(missing)} of "
                f"the model's {len(expected)} weights, e.g. {missing[:5]}; write every weight "
                "(a checkpoint, not a patch)"
            )
        _validate_specs(specs, expected)
        return specs

    def receive_weights(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo | WeightDir,
        load_weights: LoadWeightsFn,
    ) -> TransferStats:
        """Checks the directory against the model, then reads its tensors into the model.

        Every file is opened before the first tensor is written: one gone since its header was
        read refuses the update, nothing written. Weights in `params` are read in place.

        Raises:
            WeightValidationError: The directory does not match the model; nothing was written.
            WeightTransferError: Reading failed after some weights were written (a file shorter
                than its header says, say): `partially_applied`.
        """
        if self._shut_down:
            raise WeightTransferError("the disk transfer engine was shut down")
        start = time.perf_counter()
        info = self.parse_update_info(update_info)
        specs = {s.name: s for s in self.check_update(info)}
        in_place = {  # the weights whose memory takes the file's bytes as they lie
            name: t
            for name, t in (self.params or {}).items()
            if t.device.type == "cpu"
            and t.is_contiguous()
            and specs.get(name) == TensorSpec.of(name, t)
        }
        directory = Path(info.path)
        with contextlib.ExitStack() as files:
            try:
                fds = {
                    file: files.enter_context(open_regular(directory / file)).fileno()
                    for file in dict.fromkeys(file for file, _ in info._entries)
                }
            except (OSError, WeightValidationError) as exc:
                raise WeightValidationError(
                    f"update rejected before any byte moved: {exc}; the directory changed "
                    "after its headers were read"
                ) from None
            written = 0
            try:
                for file, entry in info._entries:
                    name = entry.spec.name
                    if name in specs:
                        tensor = read_tensor(fds[file], entry, out=in_place.get(name))
                        if name not in in_place:
                            load_weights([(name, tensor)])
                        written += 1
            except Exception as exc:
                raise WeightTransferError(
                    f"loading {directory} failed after {written} of {len(specs)} weights "
                    f"({type(exc).__name__}: {exc})",
                    partially_applied=True,
                ) from exc
        nbytes, seconds = sum(s.nbytes for s in specs.values()), time.perf_counter() - start
        stats = TransferStats(len(specs), nbytes, num_buckets=len(fds), seconds=seconds)
        logger.info(
            "loaded %d tensors, %.1f MB from %s in %.3f s (%.2f GB/s)",
            stats.num_tensors, stats.num_bytes / 1e6, directory, stats.seconds, stats.gbps,
        )  # fmt: skip
        return stats

    def shutdown(self) -> None:
        """Marks the engine shut down (it holds nothing between updates). Safe to call twice."""
        self._shut_down = True


def save_weight_dir(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    path: str | os.PathLike[str],
    *,
    weight_version: str | int | None = None,
) -> dict[str, Any]:
    """The trainer's side: writes tensors to `path/model.safetensors`, renamed into place when whole.

    Args:
        named_tensors: `(name, tensor)` pairs, e.g. `model.named_parameters()`.
        path: The directory, created if needed; a fresh one per update.
        weight_version: Optional label the update info carries.

    Returns:
        The update info to send: `{"path": DIR}` (and `weight_version` when given).

    >>> import tempfile
    >>> sorted(save_weight_dir([("w", torch.ones(2))], tempfile.mkdtemp()))
    ['path']
    """
    directory = Path(path).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / ".model.safetensors.partial"
    write_safetensors({name: tensor.detach() for name, tensor in named_tensors}, partial)
    os.replace(partial, directory / "model.safetensors")
    return WeightDir(str(directory), weight_version).to_dict()
