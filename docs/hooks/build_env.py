"""MkDocs hook: adapts the build to where it runs.

- `DOCS_OFFLINE=1` drops the Python and PyTorch inventories from mkdocstrings' configuration, for
  machines that cannot download them (a failed download is a warning, and the build is strict).
  Signatures then show `torch.Tensor` unlinked; the online build (Read the Docs) links it.
- Snippets (`--8<--`) resolve against the repository root wherever `mkdocs` is started from.
- The navigation files (`SUMMARY.md`) are read, never built as pages.
"""

from __future__ import annotations

import logging
import os
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
    return config


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
