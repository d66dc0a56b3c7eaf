"""Generates one page per `examples/rlhf/*.py`, and the examples' nav.

Each page has a title made from the file name, the module docstring as its introduction, how to
run it (with the options its argparse parser declares, read from the source), and the file itself,
embedded through `pymdownx.snippets` so that the page always shows the file as it is. Where a run
log of the example is committed, the page also shows pictures of that run (`example_plots.py`).
Adding an example file adds its page; nothing else needs editing.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_plots import pictures  # a sibling module, found through the line above

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "rlhf"
# Words kept in a fixed spelling when a file name becomes a title.
SPELLING = {
    "api": "API",
    "cpu": "CPU",
    "dp": "DP",
    "gpu": "GPU",
    "hf": "HF",
    "http": "HTTP",
    "ipc": "IPC",
    "kv": "KV",
    "lora": "LoRA",
    "nccl": "NCCL",
    "ray": "Ray",
    "rl": "RL",
    "rlhf": "RLHF",
    "shm": "shared memory",
}


def title_of(path: Path) -> str:
    """`broadcast_sync.py` -> `Broadcast sync`; known acronyms keep their spelling."""
    words = [SPELLING.get(word, word) for word in path.stem.split("_") if word]
    words[0] = words[0][:1].upper() + words[0][1:]
    return " ".join(words)


def _literal(node: ast.expr | None) -> str:
    if node is None:
        return ""
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return ast.unparse(node)


def cli_options(tree: ast.Module) -> list[tuple[str, str, str]]:
    """`(flag, default, help)` of every `add_argument("--flag", ...)` call in the source."""
    options = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("-")
        ):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        flag = str(node.args[0].value)
        if _literal(keywords.get("action")).endswith("BooleanOptionalAction"):
            flag = f"{flag} / --no-{flag.lstrip('-')}"
        help_node = keywords.get("help")
        help_text = help_node.value if isinstance(help_node, ast.Constant) else ""
        options.append((flag, _literal(keywords.get("default")), str(help_text)))
    return options


def page(path: Path) -> str:
    """The markdown of the page for the example at `path`."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    relative = path.relative_to(ROOT).as_posix()
    docstring = ast.get_docstring(tree) or ""
    lines = [f"# {title_of(path)}", "", docstring, "", "## How to run", ""]
    lines += [
        "From a clone of the repository:",
        "",
        "```bash",
        "pip install -e .",
        f"python {relative}",
        "```",
        "",
        "It runs on a CPU-only machine. The test suite runs it too (`tests/integration/"
        "test_examples.py`), so what this page shows is what passes there.",
        "",
    ]
    options = cli_options(tree)
    if options:
        lines += ["| Option | Default | Meaning |", "| --- | --- | --- |"]
        lines += [
            f"| `{flag}` | {f'`{default}`' if default else ''} | {text.replace('|', '/')} |"
            for flag, default, text in options
        ]
        lines.append("")
    lines += pictures(path.stem)
    lines += [
        "## The script",
        "",
        f'```python title="{relative}" linenums="1"',
        f'--8<-- "{relative}"',
        "```",
        "",
    ]
    return "\n".join(lines)


# The order to read the examples in, first to last, and what each adds to the ones before it.
START_HERE = [
    (
        "async_rl",
        "the whole story in one run: an engine generates while the trainer learns, "
        "and each new policy lands in the rollouts in flight (`keep` pause)",
    ),
    ("pause_resume", "the pause modes side by side on the same requests in flight"),
    ("broadcast_sync", "the data plane alone: a trainer broadcasts into two receivers (gloo)"),
    ("rlhf_nccl", "a trainer and two engine processes on one broadcast group"),
    ("rlhf_http_nccl", "the same into a running `weightsync serve`, driven over HTTP"),
    ("rlhf_ipc", "colocated: weights through memory handles instead of a broadcast"),
    ("rlhf_http_ipc", "memory handles into a server, over HTTP"),
    ("rlhf_lora", "a LoRA adapter trained and synced alone, into rollouts that never pause"),
    ("hf_trainer", "a `transformers` model as the trainer, serving its own directory"),
    ("multi_rank_trainer", "a sharded (FSDP2) trainer: rank 0 sends, every rank gathers"),
    ("rlhf_ray", "trainer and servers placed as Ray actors (needs the `ray` extra)"),
]


def main() -> None:
    """Writes `examples/<stem>.md` per example, an index page and `examples/SUMMARY.md`."""
    paths = sorted(EXAMPLES.glob("*.py"))
    nav = mkdocs_gen_files.Nav()
    index = [
        "# Examples",
        "",
        "Runnable scripts over the public API, from `examples/rlhf/` in the repository. Each "
        "one checks its own outcome and is run by the test suite.",
        "",
        "## Start here",
        "",
        "In this order, each one adding to the ones before it:",
        "",
        *(
            f"{rank}. [{title_of(EXAMPLES / f'{stem}.py')}]({stem}.md): {why}"
            for rank, (stem, why) in enumerate(START_HERE, start=1)
        ),
        "",
        "## Every example",
        "",
        "| Example | What it shows |",
        "| --- | --- |",
    ]
    nav["Examples"] = "index.md"
    for path in paths:
        name = f"{path.stem}.md"
        with mkdocs_gen_files.open(f"examples/{name}", "w") as out:
            out.write(page(path))
        mkdocs_gen_files.set_edit_path(f"examples/{name}", path.relative_to(ROOT))
        nav[title_of(path)] = name
        summary = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split(
            "\n"
        )[0]
        index.append(f"| [{title_of(path)}]({name}) | {summary.replace('|', '/')} |")
    with mkdocs_gen_files.open("examples/index.md", "w") as out:
        out.write("\n".join(index) + "\n")
    with mkdocs_gen_files.open("examples/SUMMARY.md", "w") as summary_file:
        summary_file.writelines(nav.build_literate_nav())


main()
