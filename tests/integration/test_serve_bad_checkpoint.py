"""A broken or hostile checkpoint directory: `weightsync serve DIR` refuses it in one line.

Each case damages one file of a sound directory (absurd sizes in `config.json`, a garbage
`model.safetensors` header, an integer dtype where a float weight belongs, a `chat_template.jinja`
that is not UTF-8) and runs the real command on it: exit status 2, one line on stderr naming the
file, the key and what is wrong, no traceback, and nothing allocated first (the sizes are checked
against maxima and against the machine's memory before the model is built).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from serve_support import run_cli

from model_dirs import write_model_dir

pytestmark = pytest.mark.reliability("bad-input")

WEIGHT = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def sound_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2")


def config_with(**changes: Any) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **changes}))

    return damage


def safetensors(header: Any, data: bytes = b"") -> Callable[[Path], None]:
    """Replaces model.safetensors with `header` (JSON, or raw bytes) and `data`."""

    def damage(path: Path) -> None:
        encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
        (path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)

    return damage


def raw(name: str, content: bytes) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        (path / name).write_bytes(content)

    return damage


def integer_dtype(path: Path) -> None:
    """The embedding's header says I32 (same bytes as its F32): once cast, a model of nonsense."""
    blob = (path / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    assert header[WEIGHT]["dtype"] == "F32"
    header[WEIGHT]["dtype"] = "I32"
    encoded = json.dumps(header).encode()
    data = blob[8 + length :]
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}

# (id, damage, file named, key named, what is wrong)
CASES: list[tuple[str, Callable[[Path], None], str, str, str]] = [
    ("vocab-size-1e9", config_with(vocab_size=10**9), "config.json", "vocab_size",
     "is 1000000000, more than the 4194304 that any model of the family has"),
    ("max-position-embeddings-1e10", config_with(max_position_embeddings=10**10), "config.json",
     "max_position_embeddings", "is 10000000000, more than the 16777216"),
    ("head-dim-2-40", config_with(head_dim=2**40), "config.json", "head_dim",
     f"is {2**40}, more than the 4096"),
    ("intermediate-size-1e11", config_with(intermediate_size=10**11), "config.json",
     "intermediate_size", "is 100000000000, more than the 1048576"),
    # Each size within its maximum, together about 900 TB: more than any machine has.
    ("larger-than-the-machine", config_with(vocab_size=1 << 22, hidden_size=1 << 16, head_dim=128,
                                            intermediate_size=1 << 20, num_hidden_layers=1 << 10),
     "config.json", "vocab_size 4194304, hidden_size 65536", "GB of memory this machine has"),
    ("safetensors-under-8-bytes", raw("model.safetensors", b"abc"), "model.safetensors",
     "3 bytes", "is too short for a safetensors file"),
    ("header-not-json", safetensors(b"{not json"), "model.safetensors", "safetensors header",
     "is not JSON"),
    ("header-a-list", safetensors([1, 2]), "model.safetensors", "safetensors header",
     "must be a JSON object, got list"),
    ("entry-a-string", safetensors({WEIGHT: "F32"}), "model.safetensors", WEIGHT,
     "entry must be a JSON object, got 'F32'"),
    ("entry-without-data-offsets", safetensors({WEIGHT: {"dtype": "F32", "shape": [2]}}),
     "model.safetensors", WEIGHT, "has no 'data_offsets'"),
    ("shape-of-strings", safetensors({WEIGHT: {**ENTRY, "shape": ["2", "2"]}}, bytes(16)),
     "model.safetensors", WEIGHT, "shape must be a list of ints >= 0 (each below 2**63), got ['2', '2']"),
    ("shape-negative", safetensors({WEIGHT: {**ENTRY, "shape": [-2, -2]}}, bytes(16)),
     "model.safetensors", WEIGHT, "shape must be a list of ints >= 0 (each below 2**63), got [-2, -2]"),
    ("offsets-past-the-file", safetensors({WEIGHT: {**ENTRY, "data_offsets": [0, 10**12]}}),
     "model.safetensors", WEIGHT, "has inconsistent data_offsets [0, 1000000000000]"),
    ("integer-dtype-for-a-float-weight", integer_dtype, "model.safetensors", WEIGHT,
     "has dtype int32, but the model's weights are floating point"),
    ("chat-template-not-utf-8", raw("chat_template.jinja", b"\xff\xfe{{ messages }}"),
     "chat_template.jinja", "chat_template.jinja", "is not UTF-8 text"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "file", "key", "wrong"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_damaged_checkpoint_is_refused_in_one_line(
    sound_dir, tmp_path, damage, file, key, wrong, record_property
):
    """A damaged checkpoint directory: exit status 2 and one line naming the file and the key."""
    path = shutil.copytree(sound_dir, tmp_path / "model")
    damage(path)
    result = run_cli("serve", str(path), "--port", "0", "--log-level", "warning")
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    (line,) = lines
    assert line.startswith("weightsync serve: error: ")
    assert str(path / file) in line
    assert key in line
    assert wrong in line
    assert result.returncode == 2
    record_property("exit_status", result.returncode)
    record_property("message", line.replace(str(path), "DIR")[:160])
