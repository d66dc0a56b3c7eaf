"""MkDocs hook: adapts the build to where it runs.

- `DOCS_OFFLINE=1` drops the Python and PyTorch inventories from mkdocstrings' configuration, for
  machines that cannot download them (a failed download is a warning, and the build is strict).
  Signatures then show `torch.Tensor` unlinked; the online build (Read the Docs) links it.
- Snippets (`--8<--`) resolve against the repository root wherever `mkdocs` is started from.
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
