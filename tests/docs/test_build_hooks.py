"""The build's own helpers: the offline hook and the doctest-fencing griffe extension."""

from __future__ import annotations

import importlib.util
import subprocess
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


class _Config(dict):
    """What the hook reads of mkdocs' configuration: keys, and a few attributes."""

    def __init__(self, root: Path, inventories: list[str]) -> None:
        super().__init__(repo_url=None, repo_name=None, edit_uri=None)
        plugin = SimpleNamespace(
            config=SimpleNamespace(handlers={"python": {"inventories": inventories}})
        )
        self.config_file_path = str(root / "mkdocs.yml")
        self.mdx_configs = {"pymdownx.snippets": {"base_path": ["."]}}
        self.plugins = {"mkdocstrings": plugin}


def _config(inventories: list[str], root: Path = ROOT) -> _Config:
    return _Config(root, inventories)


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository with no remote, on branch `dev`; Read the Docs' variables unset."""
    monkeypatch.delenv("READTHEDOCS_GIT_CLONE_URL", raising=False)
    monkeypatch.delenv("READTHEDOCS_GIT_IDENTIFIER", raising=False)
    _git(tmp_path, "init", "--quiet", "--initial-branch=dev")
    (tmp_path / "mkdocs.yml").write_text("site_name: x\n")
    return tmp_path


def test_read_the_docs_clone_url_links_the_repository(hook, clone, monkeypatch):
    monkeypatch.setenv("READTHEDOCS_GIT_CLONE_URL", "git@github.com:acme/weightsync.git")
    monkeypatch.setenv("READTHEDOCS_GIT_IDENTIFIER", "v0.1")
    _git(clone, "remote", "add", "origin", "https://example.org/other/repo.git")
    config = hook.on_config(_config([], clone))
    assert config["repo_url"] == "https://github.com/acme/weightsync"
    assert config["repo_name"] == "acme/weightsync"
    assert config["edit_uri"] == "edit/v0.1/docs/"


def test_a_local_build_links_git_remote_origin(hook, clone):
    _git(clone, "remote", "add", "origin", "https://user:token@gitlab.com/acme/ws.git")
    config = hook.on_config(_config([], clone))
    # The credentials in the remote never reach the pages.
    assert config["repo_url"] == "https://gitlab.com/acme/ws"
    assert config["edit_uri"] == "-/edit/dev/docs/"


def test_no_remote_leaves_the_link_out(hook, clone):
    config = hook.on_config(_config([], clone))
    assert (config["repo_url"], config["repo_name"], config["edit_uri"]) == (None, None, None)


def test_a_remote_that_is_a_path_leaves_the_link_out(hook, clone):
    _git(clone, "remote", "add", "origin", str(clone.parent))
    config = hook.on_config(_config([], clone))
    assert config["repo_url"] is None and config["edit_uri"] is None


def test_the_configured_repo_url_is_kept(hook, clone, monkeypatch):
    monkeypatch.setenv("READTHEDOCS_GIT_CLONE_URL", "https://github.com/acme/weightsync.git")
    config = _config([], clone)
    config["repo_url"] = "https://github.com/mine/fork"
    assert hook.on_config(config)["repo_url"] == "https://github.com/mine/fork"


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
