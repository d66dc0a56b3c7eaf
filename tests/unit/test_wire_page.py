"""docs/transfer/wire.md, checked against the code it specifies, so that the page cannot drift.

The page's tables (each after a `<!-- wire-check: NAME -->` marker), its JSON examples and its
plain-Python recipes are read from the Markdown source and compared with the dataclasses,
constants and functions of `weightsync.transfer`; a real gloo group, on threads, shows which
keys the store holds. The recipes run again here: they must give the code's results on any
input, and the page's trainer without weightsync must update a weightsync worker.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync import GlooWeightTransferEngine, WeightTransferUpdateInfo, WeightValidationError
from weightsync.transfer import base as wire
from weightsync.transfer import buckets as packing
from weightsync.transfer import group as _group
from weightsync.transfer import ipc, nccl
from weightsync.transfer.base import _WIRE_DTYPES, TensorSpec, dtype_name
from weightsync.transfer.memory import _RECORD_KEYS, CUDAStorageHandle
from weightsync.transfer.nccl import NCCLTrainerSendWeightsArgs, trainer_init

PAGE = Path(__file__).resolve().parents[2] / "docs" / "transfer" / "wire.md"


def _unfolded(text: str) -> str:
    """The page with its folded parts (`??? kind "title"`, body indented by 4) opened out."""
    lines, folded = [], False
    for line in text.splitlines():
        if line.startswith("??? "):
            folded = True
            continue
        if folded and line and not line.startswith("    "):
            folded = False
        lines.append(line[4:] if folded else line)
    return "\n".join(lines) + "\n"


TEXT = _unfolded(PAGE.read_text(encoding="utf-8"))
PROSE = " ".join(TEXT.split())  # what a reader reads: wrapped lines joined
TIMEOUT_S = 30.0
PAGE_BLOCK_TIMEOUT_S = 60.0


def _rows(name: str) -> list[dict[str, str]]:
    """The Markdown table right after `<!-- wire-check: NAME -->`, as dicts by header."""
    marker = f"<!-- wire-check: {name} -->"
    assert marker in TEXT, f"the page lost its {name!r} table"
    lines = TEXT.split(marker, 1)[1].strip().splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, _, *body = table
    return [dict(zip(header, row, strict=True)) for row in body]


def _json_after(name: str) -> Any:
    """The ```json block right after `<!-- wire-check: NAME -->`."""
    rest = TEXT.split(f"<!-- wire-check: {name} -->", 1)[1]
    match = re.match(r"\s*```json\n(.*?)\n```", rest, re.DOTALL)
    assert match, f"no JSON block after the {name!r} marker"
    return json.loads(match[1])


def _code(cell: str) -> list[str]:
    """The `code spans` of a table cell."""
    return re.findall(r"`([^`]+)`", cell)


def _python_blocks() -> list[str]:
    return re.findall(r"^```python[^\n]*\n(.*?)^```$", TEXT, re.MULTILINE | re.DOTALL)


def _run_blocks(count: int) -> dict[str, Any]:
    """Runs the page's first `count` Python blocks in one namespace, as the docs tests chain them."""
    namespace: dict[str, Any] = {"__name__": "wire_page"}
    for block in _python_blocks()[:count]:
        exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


RECIPES = _run_blocks(2)  # the identities, then the bucket plan


# --- the rendezvous -----------------------------------------------------------------------------


def test_the_init_info_table_is_the_dataclass_field_by_field():
    rows = _rows("init-info")
    fields = [f for f in dataclasses.fields(nccl.NCCLWeightTransferInitInfo) if f.init]
    assert [_code(row["Key"])[0] for row in rows] == [f.name for f in fields]
    json_types = {str: "string", int: "int", bool: "bool", float: "number"}
    for row, field in zip(rows, fields, strict=True):
        annotation = {"str": str, "int": int, "bool": bool, "float": float}[str(field.type)]
        assert row["JSON type"] == json_types[annotation], field.name
        if field.default is dataclasses.MISSING:
            assert row["Default"] == "(required)", field.name
        else:
            documented = _code(row["Default"])[0]
            assert json.loads(documented) == field.default, field.name


def test_the_wire_key_lists_what_the_trainer_publishes_and_workers_compare():
    row = next(r for r in _rows("store-keys") if _code(r["Key"]) == ["wire"])
    group = trainer_init(world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    try:
        published = json.loads(group._group._store.get("wire"))
    finally:
        group.close()
    assert _code(row["Value"]) == list(published) == list(nccl._WIRE_KEYS)


class _NoteTakingGroup:
    """A rank's end of a group that only notes what it is told to write."""

    def __init__(self, rank: int) -> None:
        self.rank, self.written, self.closed, self.timeout_s = rank, {}, False, 5.0

    def set(self, key: str, value: Any, limit_s: float | None = None) -> None:
        self.written[key] = value

    def close(self) -> None:
        self.closed = True


def _pattern(key: str) -> str:
    """A concrete store key as the page writes it, with its numbers named."""
    for regex, pattern in (
        (r"^update/early/\d+$", "update/early/{rank}"),
        (r"^update/\d+/answer/\d+$", "update/{n}/answer/{rank}"),
        (r"^update/\d+/decision$", "update/{n}/decision"),
        (r"^update/\d+$", "update/{n}"),
        (r"^rank/\d+$", "rank/{rank}"),
        (r"^abort/\d+$", "abort/{rank}"),
        (r"^weightsync/.*$", "weightsync/..."),
    ):
        if re.match(regex, key):
            return pattern
    return key


def test_the_store_keys_table_names_every_key_the_code_writes():
    documented = {_code(row["Key"])[0] for row in _rows("store-keys")}
    from_code = {
        "wire",
        _group.INIT_ERRORS,
        nccl._LATEST,
        nccl._update_key("{n}"),  # type: ignore[arg-type]
        nccl._answer_key("{n}", "{rank}"),  # type: ignore[arg-type]
        nccl._decision_key("{n}"),  # type: ignore[arg-type]
        nccl._early_key("{rank}"),  # type: ignore[arg-type]
        "rank/{rank}",
        "abort/{rank}",
        "weightsync/...",
    }
    assert documented == from_code
    aborting = _NoteTakingGroup(rank=3)
    nccl._abort(aborting, WeightValidationError("no"))
    assert aborting.written == {"abort/3": "WeightValidationError: no"} and aborting.closed


def _run_updates() -> tuple[dict[str, bytes], str, list[TensorSpec]]:
    """Three accepted updates and one the worker refuses early, over a real gloo group."""
    trainer_weights = {"a": torch.randn(5), "b": torch.randn(2, 3)}
    engine = GlooWeightTransferEngine(
        params={k: torch.zeros_like(v) for k, v in trainer_weights.items()}
    )
    group = trainer_init(world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    infos = [
        WeightTransferUpdateInfo.from_named_tensors(trainer_weights.items()).to_dict()
        for _ in range(3)
    ]
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            engine.init_transfer_engine(group.init_info)
            for info in infos:
                engine.receive_weights(info, lambda pairs: None)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for info in infos:
            nccl.trainer_send_weights(
                trainer_weights.items(), NCCLTrainerSendWeightsArgs(group, info)
            )
        thread.join(TIMEOUT_S)
        assert not errors and not thread.is_alive()
        stranger = {"c": torch.zeros(1)}
        refused = WeightTransferUpdateInfo.from_named_tensors(stranger.items()).to_dict()
        with pytest.raises(WeightValidationError, match="unknown name 'c'"):
            engine.receive_weights(refused, lambda pairs: None)  # before the trainer is there
        with pytest.raises(WeightValidationError, match="rejected before any byte moved by rank 1"):
            nccl.trainer_send_weights(stranger.items(), NCCLTrainerSendWeightsArgs(group, refused))
        store = group._group._store
        held = {key: bytes(store.get(key)) for key in store.list_keys()}
    finally:
        engine.shutdown()
        group.close()
    specs = WeightTransferUpdateInfo(**{k: infos[2][k] for k in ("names", "dtype_names", "shapes")})
    return held, nccl._send_identity(infos[2]), specs.specs()


def test_the_store_holds_what_the_page_says_after_real_updates():
    held, third_send, third_specs = _run_updates()
    documented = {_code(row["Key"])[0] for row in _rows("store-keys")}
    assert {_pattern(key) for key in held} <= documented
    # "the keys of update n - 2" go once update n is decided: 4 was, so 1 and 2 are gone
    assert "it deletes `update/{n-2}`" in PROSE
    assert sorted(k for k in held if re.match(r"^update/\d+$", k)) == ["update/3", "update/4"]
    assert json.loads(held["update/latest"]) == 4
    assert json.loads(held["update/3"]) == {
        "send": third_send,
        "tensors": 2,
        "digest": nccl._metadata_digest(third_specs),
    }
    assert json.loads(held["update/3/answer/1"]) == {"ok": True}
    assert json.loads(held["update/3/decision"]) == {"go": True}
    assert json.loads(held["update/4/decision"])["refused"].startswith("rank 1: ")
    [early] = json.loads(held["update/early/1"])
    assert set(early) == {"update", "send", "digest", "refused"} and early["update"] == 4
    for rank in ("rank/0", "rank/1"):
        assert re.fullmatch(r"[0-9a-f]{32}", held[rank].decode())  # plain text, not JSON


# --- the round ----------------------------------------------------------------------------------

_NAMES = st.text(min_size=1, max_size=12)  # any Unicode: the digest escapes it as \uXXXX
_SHAPES = st.lists(st.integers(0, 70), max_size=3)
_SPECS = st.lists(
    st.tuples(_NAMES, st.sampled_from(sorted(_WIRE_DTYPES)), _SHAPES),
    max_size=12,
    unique_by=lambda spec: spec[0],
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(specs=_SPECS)
def test_the_page_digest_recipe_is_the_code_byte_for_byte(specs):
    tensor_specs = [
        TensorSpec(name, _WIRE_DTYPES[dtype], tuple(shape)) for name, dtype, shape in specs
    ]
    assert RECIPES["metadata_digest"](specs) == nccl._metadata_digest(tensor_specs)


_VALUES = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=5))


@settings(max_examples=200, deadline=None)
@given(
    info=st.dictionaries(
        st.sampled_from(["names", "dtype_names", "shapes", "weight_version", "send_id", "x"]),
        st.one_of(_VALUES, st.lists(_VALUES, max_size=3)),
    )
)
def test_the_page_send_recipe_is_the_code_for_any_json_object(info):
    assert RECIPES["send_identity"](info) == nccl._send_identity(info)


def test_a_message_and_its_parsed_info_have_the_send_the_page_computes():
    info = WeightTransferUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[2]])
    assert RECIPES["send_identity"](info.to_dict()) == nccl._send_identity(info)


# --- the data -----------------------------------------------------------------------------------


def test_the_page_dtype_table_is_the_wire_dtype_table():
    itemsize = RECIPES["ITEMSIZE"]
    assert list(itemsize) == list(_WIRE_DTYPES)
    assert itemsize == {name: dtype.itemsize for name, dtype in _WIRE_DTYPES.items()}
    assert RECIPES["ALIGN_BYTES"] == packing.ALIGN_BYTES
    assert (
        f"[`ALIGN_BYTES`][weightsync.transfer.buckets.ALIGN_BYTES] ({packing.ALIGN_BYTES})" in PROSE
    )


def _vllm_buckets(nbytes: list[int], limit: int) -> list[int]:
    """The bucket of each tensor under vLLM's rule as the page states it (for its last column)."""
    buckets, total, number = [], 0, 0
    for size in nbytes:
        buckets.append(number)
        total += size
        if total > limit:
            number, total = number + 1, 0
    return buckets


def test_the_worked_bucket_plan_is_plan_buckets_output():
    rows = _rows("bucket-plan")
    bucket_size = int(re.search(r"`bucket_size_bytes = (\d+)`", TEXT)[1])  # type: ignore[index]
    specs = [
        TensorSpec(_code(r["Tensor"])[0], _WIRE_DTYPES[r["dtype"]], tuple(json.loads(r["shape"])))
        for r in rows
    ]
    assert [int(r["nbytes"]) for r in rows] == [s.nbytes for s in specs]
    placed = [
        (number, slot.offset)
        for number, bucket in enumerate(packing.plan_buckets(specs, bucket_size))
        for slot in bucket.slots
    ]
    assert [(int(r["Bucket"]), int(r["Offset"])) for r in rows] == placed
    lengths = [b.nbytes for b in packing.plan_buckets(specs, bucket_size)]
    assert (
        f"The buckets are {lengths[0]}, {lengths[1]}, {lengths[2]} and {lengths[3]} bytes" in PROSE
    )
    assert [int(r["vLLM's bucket"]) for r in rows] == _vllm_buckets(
        [s.nbytes for s in specs], bucket_size
    )
    # The recipe block's example is the same one.
    assert [(n, d, list(s)) for n, d, s in RECIPES["EXAMPLE"]] == [
        (s.name, dtype_name(s.dtype), list(s.shape)) for s in specs
    ]


@settings(max_examples=300, deadline=None)
@given(specs=_SPECS, bucket_size=st.integers(1, 3000))
def test_the_page_plan_recipe_is_plan_buckets(specs, bucket_size):
    tensor_specs = [
        TensorSpec(name, _WIRE_DTYPES[dtype], tuple(shape)) for name, dtype, shape in specs
    ]
    expected = [
        (b.nbytes, [(s.spec.name, s.offset, s.spec.nbytes) for s in b.slots])
        for b in packing.plan_buckets(tensor_specs, bucket_size)
    ]
    assert RECIPES["plan_buckets"](specs, bucket_size) == expected


# --- a trainer of one's own ---------------------------------------------------------------------


def test_the_page_trainer_without_weightsync_updates_a_weightsync_worker():
    blocks = _python_blocks()
    assert len(blocks) == 3 and "weightsync" not in blocks[0] + blocks[1]
    trainer = blocks[2]
    assert "from weightsync import GlooWeightTransferEngine" in trainer  # the worker side only
    assert "trainer_init" not in trainer and "trainer_send_weights" not in trainer
    done: list[BaseException | None] = []

    def run() -> None:  # bounded: a protocol mismatch must fail this test, not hang it
        try:
            _run_blocks(3)
            done.append(None)
        except BaseException as exc:
            done.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PAGE_BLOCK_TIMEOUT_S)
    assert done, "the page's trainer did not finish"
    if done[0] is not None:
        raise done[0]


# --- IPC ----------------------------------------------------------------------------------------


def test_the_ipc_examples_are_deliveries_a_worker_parses():
    announcement = ipc.IPCWeightTransferUpdateInfo(**_json_after("ipc-announcement"))
    part = ipc.IPCWeightTransferUpdateInfo(**_json_after("ipc-part"))
    assert announcement.is_announcement and not part.is_announcement
    assert part.update_id == announcement.update_id and part.specs() == announcement.specs()
    [bucket] = packing.plan_buckets(part.specs(), wire.WireParams().bucket_size_bytes)
    assert [h.offset for h in part.handles()] == [s.offset for s in bucket.slots]
    session = part.handles()[0].segment.rsplit("-", 1)[0]  # type: ignore[union-attr]
    assert ipc.IPCWeightTransferInitInfo(session=session).backend == "ipc"
    assert json.loads(json.dumps(part.to_dict())) == _json_after("ipc-part")


def test_the_ipc_tables_list_every_field():
    delivery = {k for row in _rows("ipc-update-info") for k in _code(row["Key"])}
    fields = {f.name for f in dataclasses.fields(ipc.IPCWeightTransferUpdateInfo) if f.init}
    assert delivery == fields
    assert {_code(row["Key"])[0] for row in _rows("ipc-record")} == _RECORD_KEYS
    assert [_code(row["Key"])[0] for row in _rows("ipc-cuda")] == [
        f.name for f in dataclasses.fields(CUDAStorageHandle)
    ]


# --- numbers and texts the page quotes -----------------------------------------------------------


def test_the_numbers_the_page_states_are_the_code_constants():
    from weightsync.transfer import memory as _cuda_ipc

    stated = {
        f"cut to {nccl._REASON_CHARS}": "reasons stored",
        f"last {nccl._EARLY_KEPT} such refusals": "refusals kept early",
        f"last {ipc._ANNOUNCED_IDS_KEPT} this worker": "announcements remembered",
        f"every {nccl._EAGER_PAUSE_S * 1000:g} ms for the": "eager polling",
        f"first {nccl._EAGER_FOR_S * 1000:g} ms": "eager period",
        f"up to {nccl._LONGEST_PAUSE_S * 1000:g} ms": "longest pause",
        f"own limit + {_group._STORE_GRACE_S:g} s": "store read grace",
        f"quotes the first {nccl._ERRORS_SHOWN} lines": "join errors shown",
        f"below {_cuda_ipc.REF_COUNTER_SLOTS}": "reference-count slots",
        f"holds {_cuda_ipc.REF_COUNTER_SLOTS} slots": "reference-count file",
        f"`timeout_s={wire.DEFAULT_TIMEOUT_S:g}`": "default timeout",
    }
    assert wire._RELEASE_PERIOD_S == 1.0 and "looks every second" in PROSE
    missing = [f"{what}: {phrase!r}" for phrase, what in stated.items() if phrase not in PROSE]
    assert not missing, missing


QUOTED = {
    nccl: [
        "differs from what the trainer sends",
        "update rejected before any byte moved by ",
        "which this message belongs to, was refused",
        "the update handshake timed out after",
        "did not answer within",
        "no update of the trainer's arrived",
        "the trainer decided nothing",
        "send both sides the same update_info",
        "init_info disagrees with the trainer's group",
        "weight transfer failed on the ",
        "the group is closed: initialize a new one before the next update",
        " aborted: ",
    ],
}


def _strings(module: Any) -> list[str]:
    """Every string literal of a module's source, f-strings with their fields as NUL."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else "\0" for v in node.values]
            found.append("".join(str(part) for part in parts))
    return found


@pytest.mark.parametrize("module", list(QUOTED), ids=lambda m: m.__name__)
def test_texts_the_page_quotes_are_the_code_messages(module):
    strings = _strings(module)
    for text in QUOTED[module]:
        assert text in PROSE, f"the page no longer quotes {text!r}"
        assert any(text in s for s in strings), f"{module.__name__} no longer says {text!r}"
