"""Examples are pages a user copies from: they import only the public entry points."""

import ast
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "rlhf").glob("*.py"))
PUBLIC = {"weightsync", "weightsync.trainer"}


def _weightsync_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return {m for m in modules if m == "weightsync" or m.startswith("weightsync.")}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_imports_only_public_modules(path):
    imported = _weightsync_imports(path)
    assert imported, f"{path.name} does not use weightsync"
    assert imported <= PUBLIC, (
        f"{path.name} imports {sorted(imported - PUBLIC)}; use {sorted(PUBLIC)}"
    )


# hf_trainer.py needs transformers (which brings numpy) and says so when it is absent.
TORCH_ONLY = [p for p in EXAMPLES if p.name != "hf_trainer.py"]


@pytest.mark.parametrize("path", TORCH_ONLY, ids=[p.stem for p in TORCH_ONLY])
def test_example_needs_no_numpy(path):
    source = path.read_text(encoding="utf-8")
    assert ".numpy()" not in source and "import numpy" not in source, f"{path.name} uses numpy"
