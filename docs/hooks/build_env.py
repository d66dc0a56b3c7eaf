"""MkDocs hook: adapts the build to where it runs.

- `DOCS_OFFLINE=1` drops the Python and PyTorch inventories from mkdocstrings' configuration, for
  machines that cannot download them (a failed download is a warning, and the build is strict).
  Signatures then show `torch.Tensor` unlinked; the online build (Read the Docs) links it.
- Snippets (`--8<--`) resolve against the repository root wherever `mkdocs` is started from.
- The navigation files (`SUMMARY.md`) are read, never built as pages.
- Every page links the source repository: `repo_url` (and, on GitHub or GitLab, `edit_uri`) come
  from Read the Docs' `READTHEDOCS_GIT_CLONE_URL`, else from git's `remote.origin.url`; with
  neither (or a remote that is no web address, such as a local path) the link is left out.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

log = logging.getLogger("mkdocs.hooks.build_env")


@event_priority(100)  # before mkdocstrings' on_config, which starts the inventory downloads
def on_config(config: Any) -> Any:
    """Drops the inventories when offline; pins the snippets' base path to the repo root."""
    root = Path(config.config_file_path).resolve().parent
    snippets = config.mdx_configs.setdefault("pymdownx.snippets", {})
    snippets["base_path"] = [str(root)]
    if os.environ.get("DOCS_OFFLINE") == "1":
        handlers = config.plugins["mkdocstrings"].config.handlers
        dropped = handlers.get("python", {}).pop("inventories", [])
        if dropped:
            log.info("DOCS_OFFLINE=1: not loading the inventories %s", ", ".join(dropped))
    if not config.get("repo_url"):
        _link_repository(config, root)
    return config


def _link_repository(config: Any, root: Path) -> None:
    """Sets `repo_url`, `repo_name` and `edit_uri` from where the build's source came from."""
    clone_url = os.environ.get("READTHEDOCS_GIT_CLONE_URL") or _git(
        root, "config", "remote.origin.url"
    )
    web_url = _web_url(clone_url)
    if web_url is None:
        if clone_url:
            log.info("the remote %r is no web address: the pages link no repository", clone_url)
        return
    config["repo_url"] = web_url
    host, _, path = web_url.removeprefix("https://").partition("/")
    config["repo_name"] = path
    # Read the Docs names the branch or tag it builds; a local build edits the checked-out branch.
    # A detached checkout names no branch: its edits go to main.
    branch = (
        os.environ.get("READTHEDOCS_GIT_IDENTIFIER")
        or _git(root, "symbolic-ref", "--short", "HEAD")
        or "main"
    )
    if host == "github.com":
        config["edit_uri"] = f"edit/{branch}/docs/"
    elif host == "gitlab.com":
        config["edit_uri"] = f"-/edit/{branch}/docs/"


def _web_url(clone_url: str | None) -> str | None:
    """The repository's web address for a clone URL (https, ssh or scp-like), else None."""
    if not clone_url:
        return None
    url = clone_url.strip()
    scp_like = re.fullmatch(r"[\w.-]+@([\w.-]+):(?!//)(.+)", url)  # git@github.com:owner/name
    if scp_like:
        url = f"https://{scp_like[1]}/{scp_like[2]}"
    url = re.sub(r"^(?:ssh|git|git\+ssh|http)://(?:[^@/]+@)?", "https://", url)
    url = re.sub(r"^https://[^@/]+@", "https://", url)  # credentials never reach the pages
    match = re.fullmatch(r"https://([\w.-]+\.[a-z]{2,})(?::\d+)?/(.+?)(?:\.git)?/?", url)
    if match is None:
        return None
    return f"https://{match[1]}/{match[2]}"


def _git(root: Path, *args: str) -> str | None:
    """One line of git's answer in `root`, or None (no git, no repository, no such value)."""
    try:
        result = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


@event_priority(-200)  # after literate-nav (-100), which reads the nav files first
def on_files(files: Any, config: Any) -> Any:
    """Keeps the nav files (`SUMMARY.md`, generated ones included) out of the built site.

    literate-nav only reads them; built, they would be stray pages that search indexes.
    """
    from mkdocs.structure.files import InclusionLevel

    for file in files:
        if Path(file.src_uri).name == "SUMMARY.md":
            file.inclusion = InclusionLevel.EXCLUDED
    return files
