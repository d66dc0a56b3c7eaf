"""Generates the API reference: one page per public module of `src/weightsync`, and its nav.

A module is public when no part of its dotted path starts with `_`. A module's page renders it
with mkdocstrings (`::: weightsync.x.y`), members filtered by its `__all__`. A package's page shows
its docstring, the names it defines itself, a table of what its `__all__` re-exports (linked to
where each is defined) and its public submodules: every name is documented once, on the page of
the module that defines it, so that search leads to one place.

Sources are read statically with griffe, like mkdocstrings does: no torch needed.
"""

from __future__ import annotations

from pathlib import Path

import griffe
import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = "weightsync"


def _summary(obj: griffe.Object | griffe.Alias) -> str:
    """First line of a docstring, safe inside a table cell."""
    docstring = obj.docstring
    if docstring is None or not docstring.value.strip():
        return ""
    return docstring.value.strip().splitlines()[0].replace("|", "\\|")


def _public_modules(module: griffe.Module) -> list[griffe.Module]:
    """`module` and its public submodules, depth first, in name order."""
    found = [module]
    for name, sub in sorted(module.modules.items()):
        if not name.startswith("_") and not sub.is_alias:
            found.extend(_public_modules(sub))
    return found


def _is_package(module: griffe.Module) -> bool:
    """A package or a subpackage (griffe calls only the top-level one a package)."""
    return module.is_package or module.is_subpackage


def _defined_publicly_elsewhere(member: griffe.Object | griffe.Alias) -> bool:
    """Whether `member` is a re-export of a name that a public module's page documents."""
    if not isinstance(member, griffe.Alias):
        return False
    return not any(part.startswith("_") for part in member.final_target.path.split(".")[:-1])


def _package_page(package: griffe.Module) -> str:
    exports = [str(name) for name in package.exports or ()]
    # Names whose only public home is this package (defined here, or in a private module) are
    # documented here; other re-exports only where they are defined.
    own = [name for name in exports if not _defined_publicly_elsewhere(package[name])]
    exports = [name for name in exports if name not in own]
    members = "[" + ", ".join(own) + "]" if own else "false"
    lines = [
        f"::: {package.path}",
        "    options:",
        "      heading_level: 1",
        f"      members: {members}",
        "      show_source: false",
        "",
    ]
    if exports:
        lines += [
            "## Public names",
            "",
            f"Importable as `from {package.path} import NAME`; each is documented where it is "
            "defined.",
            "",
            "| Name | Summary |",
            "| --- | --- |",
        ]
        for name in exports:
            member = package[name]
            target = member.final_target if isinstance(member, griffe.Alias) else member
            lines.append(f"| [`{name}`][{target.path}] | {_summary(target)} |")
        lines.append("")
    submodules = [sub for name, sub in sorted(package.modules.items()) if not name.startswith("_")]
    if submodules:
        lines += ["## Modules", "", "| Module | Summary |", "| --- | --- |"]
        lines += [f"| [`{sub.path}`][{sub.path}] | {_summary(sub)} |" for sub in submodules]
        lines.append("")
    return "\n".join(lines)


def _module_page(module: griffe.Module) -> str:
    return f"::: {module.path}\n    options:\n      heading_level: 1\n"


def main() -> None:
    """Writes `reference/**.md` and `reference/SUMMARY.md` into the build."""
    package = griffe.load(PACKAGE, search_paths=[str(SRC)], resolve_aliases=True)
    nav = mkdocs_gen_files.Nav()
    for module in _public_modules(package):
        parts = tuple(module.path.split("."))
        if _is_package(module):
            doc_path = Path(*parts, "index.md")
            text = _package_page(module)
        else:
            doc_path = Path(*parts).with_suffix(".md")
            text = _module_page(module)
        nav[parts] = doc_path.as_posix()
        with mkdocs_gen_files.open(Path("reference", doc_path), "w") as page:
            page.write(text)
        assert module.filepath is not None and not isinstance(module.filepath, list)
        mkdocs_gen_files.set_edit_path(
            Path("reference", doc_path), Path(module.filepath).relative_to(ROOT)
        )
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as summary:
        summary.writelines(nav.build_literate_nav())


main()
