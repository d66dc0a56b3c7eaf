"""The build's own helpers: the offline hook and the doctest-fencing griffe extension."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
from docs_support import DOCS, ROOT


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def hook():
    pytest.importorskip("mkdocs")
    return _load(DOCS / "hooks" / "build_env.py")


def _config(inventories: list[str]) -> SimpleNamespace:
    plugin = SimpleNamespace(
        config=SimpleNamespace(handlers={"python": {"inventories": inventories}})
    )
    return SimpleNamespace(
        config_file_path=str(ROOT / "mkdocs.yml"),
        mdx_configs={"pymdownx.snippets": {"base_path": ["."]}},
        plugins={"mkdocstrings": plugin},
    )


def test_offline_build_drops_the_inventories(hook, monkeypatch):
    monkeypatch.setenv("DOCS_OFFLINE", "1")
    config = hook.on_config(_config(["https://docs.python.org/3/objects.inv"]))
    assert "inventories" not in config.plugins["mkdocstrings"].config.handlers["python"]
    assert config.mdx_configs["pymdownx.snippets"]["base_path"] == [str(ROOT)]


def test_online_build_keeps_the_inventories(hook, monkeypatch):
    monkeypatch.delenv("DOCS_OFFLINE", raising=False)
    config = hook.on_config(_config(["https://docs.python.org/3/objects.inv"]))
    handlers = config.plugins["mkdocstrings"].config.handlers
    assert handlers["python"]["inventories"] == ["https://docs.python.org/3/objects.inv"]


def test_doctests_are_fenced_and_other_text_is_not():
    pytest.importorskip("griffe")
    fence = _load(DOCS / "hooks" / "griffe_doctest_blocks.py").fence_doctests
    text = "Adds.\n\n>>> 1 + 1\n2\n\nMore text.\n\n```python\n>>> kept as is\n```"
    assert fence(text) == (
        "Adds.\n\n```pycon\n>>> 1 + 1\n2\n```\n\nMore text.\n\n```python\n>>> kept as is\n```"
    )
    assert (
        fence("Args:\n    x: a value.\n\n    >>> indented\n")
        == "Args:\n    x: a value.\n\n    >>> indented\n"
    )
    assert fence(">>> last\n1") == "```pycon\n>>> last\n1\n```"
