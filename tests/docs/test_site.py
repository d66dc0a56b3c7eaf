"""The site builds with `mkdocs build --strict` and holds a page for everything it must cover."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_support import DOCS, REPO_URL, ROOT, BuiltSite
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SRC = ROOT / "src"
EXAMPLES = sorted((ROOT / "examples" / "rlhf").glob("*.py"))
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
EXAMPLE_LOGS = sorted((ROOT / "benchmarks" / "results" / "examples").glob("*.json"))


def _public_modules() -> list[str]:
    modules = []
    for path in sorted((SRC / "weightsync").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            modules.append(".".join(parts))
    return modules


def test_strict_build_has_no_warning(built_site: BuiltSite):
    site = built_site.require()
    assert (site / "index.html").is_file()
    warnings = [
        line for line in built_site.log.splitlines() if re.match(r"(WARNING|ERROR)\s+-", line)
    ]
    assert not warnings, "\n".join(warnings)


def test_every_page_links_the_repository(built_site: BuiltSite):
    """The header links the source on every page; each hand-written page has its edit link."""
    site = built_site.require()
    pages = sorted(site.rglob("index.html"))
    assert len(pages) > 30
    unlinked = [p for p in pages if f'href="{REPO_URL}"' not in p.read_text(encoding="utf-8")]
    assert not unlinked, f"pages without the repository link: {unlinked}"
    install = (site / "install" / "index.html").read_text(encoding="utf-8")
    assert f'href="{REPO_URL}/edit/' in install and "/docs/install.md" in install


def test_every_example_has_a_page(built_site: BuiltSite):
    site = built_site.require()
    assert EXAMPLES, "examples/rlhf holds no example"
    for path in EXAMPLES:
        page = site / "examples" / path.stem / "index.html"
        assert page.is_file(), f"no page for {path.name}"
        html = page.read_text(encoding="utf-8")
        summary = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split(
            "\n"
        )[0]
        assert summary.split("`")[0].strip() in html, f"{path.name}: the docstring is not the intro"
        assert f"python examples/rlhf/{path.name}" in html, f"{path.name}: no run command"
        # The file itself is embedded: its last function definition shows up, highlighted.
        last_def = re.findall(r"^def (\w+)", path.read_text(encoding="utf-8"), re.MULTILINE)[-1]
        assert f">{last_def}<" in html, f"{path.name}: the source is not embedded"


def test_every_public_module_has_an_api_page(built_site: BuiltSite):
    site = built_site.require()
    for module in _public_modules():
        parts = module.split(".")
        package = (SRC.joinpath(*parts) / "__init__.py").is_file()
        page = site / "reference" / Path(*parts) / "index.html"
        assert page.is_file(), f"no API page for {module}"
        assert f'id="{module}"' in page.read_text(encoding="utf-8"), (module, package)


def test_the_api_reference_documents_each_name_once(built_site: BuiltSite):
    """A package's page links its re-exports instead of documenting them again, and no nav file
    (`SUMMARY.md`) is built into a page that search would index."""
    site = built_site.require()
    homes: dict[str, list[str]] = {}
    for page in sorted((site / "reference").rglob("index.html")):
        html = page.read_text(encoding="utf-8")
        for object_id in re.findall(r'<h\d id="(weightsync[\w.]*)" class="doc doc-heading"', html):
            name = object_id.rsplit(".", 1)[-1]
            if name[:1].isupper() or "." not in object_id:  # classes, and each module once
                homes.setdefault(name, []).append(object_id)
    twice = {name: ids for name, ids in homes.items() if len(ids) > 1}
    assert not twice, f"documented on more than one page: {twice}"
    assert not list(site.rglob("SUMMARY")), "a nav file was built as a page"
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    assert not [doc["location"] for doc in index["docs"] if "SUMMARY" in doc["location"]]


def test_benchmark_results_are_plotted(built_site: BuiltSite):
    """Every results file has a chart on the performance page and says what machine made it."""
    site = built_site.require()
    html = (site / "performance" / "index.html").read_text(encoding="utf-8")
    assert RESULTS, "benchmarks/results holds no results file"
    for path in RESULTS:
        json.loads(path.read_text(encoding="utf-8"))
        charts = sorted((site / "assets" / "benchmarks").glob(f"{path.stem}*.svg"))
        charts = [c for c in charts if c.stem == path.stem or c.stem.startswith(f"{path.stem}-")]
        assert charts, f"{path.name}: no chart"
        for svg in charts:
            assert "<rect" in svg.read_text(encoding="utf-8"), svg.name
            assert f"assets/benchmarks/{svg.name}" in html, svg.name
        machine = re.search(
            rf"From <code>benchmarks/results/{re.escape(path.name)}</code>, "
            r"measured on: ([^<]+)",
            html,
        )
        assert machine and "not recorded" not in machine[1], f"{path.name}: no machine stated"


def test_example_run_logs_are_drawn(built_site: BuiltSite):
    """Each committed example log belongs to an example and its page shows the run's pictures."""
    site = built_site.require()
    stems = {path.stem for path in EXAMPLE_LOGS}
    assert {"async_rl", "pause_resume"} <= stems, "the async_rl and pause_resume logs are missing"
    for log in EXAMPLE_LOGS:
        assert (ROOT / "examples" / "rlhf" / f"{log.stem}.py").is_file(), f"{log.name}: no example"
        html = (site / "examples" / log.stem / "index.html").read_text(encoding="utf-8")
        images = re.findall(r'src="(\.\./assets/[^"]+\.svg)"', html)
        assert images, f"{log.stem}: its page shows no picture of the run"
        for image in images:
            svg = (site / "examples" / log.stem / image).resolve()
            assert "<rect" in svg.read_text(encoding="utf-8"), image
    pause_resume = (site / "examples" / "pause_resume" / "index.html").read_text(encoding="utf-8")
    for mode in ("abort", "wait", "keep"):
        assert f"pause_resume-{mode}-" in pause_resume, f"no picture of the {mode} mode"


def test_pause_resume_log_is_current(tmp_path: Path):
    """The committed pause_resume log is what the example writes today (it is deterministic)."""
    committed = ROOT / "benchmarks" / "results" / "examples" / "pause_resume.json"
    fresh = tmp_path / "pause_resume.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rlhf" / "pause_resume.py"), "--log", str(fresh)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=300,
        check=True,
    )
    assert json.loads(fresh.read_text(encoding="utf-8")) == json.loads(
        committed.read_text(encoding="utf-8")
    ), f"stale: run python examples/rlhf/pause_resume.py --log {committed.relative_to(ROOT)}"


def _locked(path: Path) -> dict[str, set[str]]:
    """A lock's pins: name -> versions (a name pinned per Python version may have several)."""
    pins: dict[str, set[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, version = line.partition(";")[0].strip().partition("==")
            pins.setdefault(canonicalize_name(name), set()).add(version)
    return pins


def test_docs_requirements_are_the_docs_extra_at_the_dev_locks_versions():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]["docs"]
    docs = _locked(DOCS / "requirements.txt")
    dev = _locked(ROOT / "requirements" / "dev.lock")
    stale = "stale: run requirements/lock"
    for requirement in map(Requirement, extra):
        versions = docs.get(canonicalize_name(requirement.name))
        assert versions, f"{requirement.name} of the docs extra is not pinned ({stale})"
        assert all(requirement.specifier.contains(v) for v in versions), (requirement, stale)
    different = {name: v for name, v in docs.items() if not v <= dev.get(name, set())}
    assert not different, f"docs/requirements.txt pins these unlike dev.lock ({stale})"
    assert "torch" not in docs


@pytest.mark.parametrize(
    ("stem", "title"),
    [
        ("hf_trainer", "HF trainer"),
        ("rlhf_ipc", "RLHF IPC"),
        ("rlhf_lora", "RLHF LoRA"),
        ("rlhf_nccl", "RLHF NCCL"),
    ],
)
def test_example_titles_keep_their_spelling(built_site: BuiltSite, stem: str, title: str):
    html = (built_site.require() / "examples" / stem / "index.html").read_text(encoding="utf-8")
    assert f"<title>{title} - " in html


@pytest.mark.parametrize("page", ["transfer/broadcast.md", "transfer/ipc.md"])
def test_each_backend_page_ends_with_the_examples_that_show_it(page: str):
    text = (DOCS / page).read_text(encoding="utf-8")
    last_section = text.rsplit("\n## ", 1)[-1]
    assert last_section.startswith("Examples"), f"{page} does not end with its examples"
    links = re.findall(r"\]\(\.\./examples/(\w+)\.md\)", last_section)
    assert links, f"{page}: its last section links no example"
    for stem in links:
        assert (ROOT / "examples" / "rlhf" / f"{stem}.py").is_file(), f"{page} links {stem}"


def test_the_documented_wire_parameters_are_the_checked_ones():
    # transfer/index.md: the trainer decides backend, world_size and the four wire parameters
    # (the last five fields of the init info table, and world_size); a worker that disagrees on
    # any of them is refused.
    from weightsync import NCCLWeightTransferInitInfo

    text = (DOCS / "transfer" / "index.md").read_text(encoding="utf-8")
    table = text.split("## The init info", 1)[1].split("\n\n| Field |", 1)[1].split("\n\n", 1)[0]
    fields = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    assert "The trainer decides `backend` and `world_size` and the four *wire parameters*" in text
    info = NCCLWeightTransferInitInfo(master_address="127.0.0.1", master_port=1, world_size=2)
    assert set(info.wire_params()) == {*fields[-5:], "world_size"}


def test_the_real_model_page_serves_the_dtype_its_trainer_sends():
    """The page's serve command and its `transformers` trainer agree on the dtype (the server
    refuses every tensor of another), and it fetches with the `hf` command that
    `huggingface_hub` ships (`huggingface-cli` is gone from it)."""
    page = (DOCS / "serving-real-models.md").read_text(encoding="utf-8")
    fences = re.findall(r"^```(\w+)\n(.*?)^```$", page, re.MULTILINE | re.DOTALL)
    (serve,) = [text for lang, text in fences if lang == "bash" and "weightsync serve" in text]
    (trainer,) = [text for lang, text in fences if lang == "python" and "from_pretrained" in text]
    served = re.search(r"--dtype (\w+)", serve)
    loaded = re.search(r"dtype=torch\.(\w+)", trainer)
    assert served is not None and loaded is not None, (serve, trainer)
    assert served[1] == loaded[1]
    assert "hf download" in serve
    pages = [ROOT / "README.md", *DOCS.rglob("*.md")]
    assert not [p for p in pages if "huggingface-cli" in p.read_text(encoding="utf-8")]


def test_the_examples_start_here_ranks_every_example_once(built_site: BuiltSite):
    """The examples page opens with the order to run them in: the demo first, each one once."""
    html = (built_site.require() / "examples" / "index.html").read_text(encoding="utf-8")
    ranked = html.split('id="start-here"', 1)[1].split("</ol>", 1)[0]
    linked = re.findall(r'<li><a href="([a-z_]+)/">', ranked)
    assert linked[0] == "async_rl"
    assert sorted(linked) == sorted(path.stem for path in EXAMPLES)


# The text column of a page at 1280 px holds 80 characters of code (Material's code font);
# a longer line scrolls sideways. docs/ruff.toml formats the pages' Python blocks to it.
CODE_COLUMN_CHARS = 80


def _code_lines(text: str) -> list[tuple[int, str, str]]:
    """`(line number, language, line)` of every line inside a fenced block, fence indent off."""
    found, fence, indent, language = [], "", "", ""
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})(\S*)", line)
        if opening and not fence:
            indent, fence, language = opening[1], opening[2], opening[3]
        elif fence and line.strip() == fence:
            fence = ""
        elif fence:
            found.append((number, language, line.removeprefix(indent)))
    return found


def test_code_blocks_fit_the_text_column():
    pages = sorted(p for p in DOCS.rglob("*.md") if p.name != "SUMMARY.md")
    wide = [
        f"{page.relative_to(DOCS)}:{number}: {len(line)} characters"
        for page in pages
        for number, language, line in _code_lines(page.read_text(encoding="utf-8"))
        if language != "mermaid" and len(line) > CODE_COLUMN_CHARS
    ]
    assert not wide, "\n".join(wide)
