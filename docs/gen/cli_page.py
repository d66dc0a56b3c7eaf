"""Generates the CLI reference page from the `weightsync` command's own argparse parser.

The parser module imports neither torch nor weightsync, so it is loaded from its file here and
the docs build needs neither; the page cannot drift from the command, since it is its help.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
PARSER = ROOT / "src" / "weightsync" / "serve" / "_parser.py"


def load_parser_module() -> ModuleType:
    """Imports `_parser.py` by path, without importing the weightsync package."""
    spec = importlib.util.spec_from_file_location("weightsync_cli_parser", PARSER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def page() -> str:
    """The page: the command's help, then each subcommand's help."""
    parser = load_parser_module().build_parser(version="")
    parser.prog = "weightsync"
    # argparse keeps its subcommands here; it has no public accessor for them.
    subcommands = parser._subparsers._group_actions[0].choices
    lines = [
        "# CLI reference",
        "",
        "Generated from the `weightsync` command's parser: what `--help` prints.",
        "",
        "## `weightsync`",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]
    for name, subparser in subcommands.items():
        lines += [
            f"## `weightsync {name}`",
            "",
            "```text",
            subparser.format_help().rstrip(),
            "```",
            "",
        ]
    return "\n".join(lines)


with mkdocs_gen_files.open("cli.md", "w") as f:
    f.write(page())
mkdocs_gen_files.set_edit_path("cli.md", "gen/cli_page.py")
