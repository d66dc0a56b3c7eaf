"""The built site, opened in headless Chromium: pages render, search works, the console stays clean.

Skips (saying why) where Chromium is absent; `.ci/run` installs Debian's `chromium`. Every request
outside the served site is refused, so the pages, their search and every mermaid diagram (drawn by
the copy of mermaid the site serves itself) are checked as a reader without network sees them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from browser_support import find_chromium, open_browser, serve_directory
from code_blocks import html_blocks
from docs_support import REPO_URL, BuiltSite

pytest.importorskip(
    "websocket", reason="websocket-client is not installed: pip install -e '.[dev]'"
)


@pytest.fixture(scope="module")
def site_url(built_site: BuiltSite) -> Iterator[str]:
    with serve_directory(built_site.require()) as url:
        yield url


@pytest.fixture(scope="module")
def page(site_url: str):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip(
            "chromium is not installed (apt-get install chromium): the built site was not "
            "opened in a browser"
        )
    with open_browser(chromium, site_url, tolerated=(_REPOSITORY_FACTS,)) as tab:
        yield tab


# Material asks the repository host's API for the stars and latest release it shows beside the
# repository link; refused, the link shows the name alone. Nothing else may leave the site.
_REPOSITORY_FACTS = REPO_URL.replace("https://github.com/", "https://api.github.com/repos/")


def _clean(page, url: str) -> None:
    assert not page.errors, f"{url}: console errors:\n" + "\n".join(page.errors)
    assert not page.refused, f"{url}: requests outside the site: {page.refused}"


def test_home_page_renders(page, site_url: str):
    page.goto(site_url)
    assert (
        page.evaluate("document.querySelector('article h1').textContent.replace('¶', '').trim()")
        == "weightsync"
    )
    code = page.evaluate(
        "Array.from(document.querySelectorAll('article .highlight code'))"
        ".map(c => c.textContent).join('\\n')"
    )
    assert "trainer_send_weights(" in code
    nav = page.evaluate(
        "Array.from(document.querySelectorAll('.md-nav__link')).map(a => a.textContent.trim())"
    )
    assert "API reference" in nav and "Troubleshooting" in nav
    _clean(page, site_url)


def test_api_page_renders(page, site_url: str):
    url = site_url + "reference/weightsync/transfer/nccl/"
    page.goto(url)
    heading = "document.getElementById('weightsync.transfer.nccl.trainer_init')"
    assert page.evaluate(f"{heading} !== null")
    signature = page.evaluate(
        f"{heading}.parentElement.querySelector('.doc-signature').textContent"
    )
    assert "world_size" in signature and "wire: WireParams" in signature
    # Cross-references inside docstrings became links.
    assert page.evaluate("document.querySelectorAll('a.autorefs-internal').length") > 10
    _clean(page, url)


def test_example_page_renders(page, site_url: str):
    url = site_url + "examples/broadcast_sync/"
    page.goto(url)
    assert (
        page.evaluate("document.querySelector('article h1').textContent.replace('¶', '').trim()")
        == "Broadcast sync"
    )
    code = page.evaluate(
        "Array.from(document.querySelectorAll('article code')).map(c => c.textContent).join('\\n')"
    )
    assert "def main() -> int:" in code
    _clean(page, url)


def test_search_finds_pause_generation(page, site_url: str):
    page.goto(site_url)
    page.evaluate("document.querySelector('input[data-md-component=search-query]').focus()")
    page.type_text("pause_generation")
    hrefs = page.wait_for(
        "Array.from(document.querySelectorAll('.md-search-result__item a')).map(a => a.href)"
    )
    assert any("async-rl" in href for href in hrefs), hrefs
    _clean(page, site_url)


def test_every_mermaid_diagram_renders_offline(page, site_url: str, built_site: BuiltSite):
    """Every diagram of every page becomes an SVG, from the site's own mermaid, with no error."""
    site = built_site.require()
    assert any((site / "assets" / "javascripts").glob("mermaid-*.min.js")), "mermaid is not served"
    pages = sorted(
        p for p in site.rglob("index.html") if 'class="mermaid"' in p.read_text(encoding="utf-8")
    )
    assert len(pages) >= 5, f"only {len(pages)} pages hold a mermaid diagram"
    drawn = 0
    for path in pages:
        count = len(re.findall(r'<pre class="mermaid">', path.read_text(encoding="utf-8")))
        url = (site_url + path.parent.relative_to(site).as_posix() + "/").replace("/./", "/")
        page.goto(url)
        # Material swaps each <pre class="mermaid"> for a <div class="mermaid"> once mermaid has
        # drawn it; a syntax error draws mermaid's error picture and logs an error.
        page.wait_for(
            "document.querySelectorAll('pre.mermaid').length === 0 && "
            f"document.querySelectorAll('div.mermaid').length === {count}",
            timeout_s=30,
        )
        diagrams = page.rendered_diagrams()
        assert len(diagrams) == count, (url, diagrams)
        assert all(d["svg"] and not d["error"] for d in diagrams), (url, diagrams)
        _clean(page, url)
        drawn += len(diagrams)
    assert drawn >= 10


def test_copied_code_is_what_the_docs_tests_run(page, site_url: str, built_site: BuiltSite):
    """The copy button's text, taken in the browser as Material takes it, is what test_pages runs.

    Material copies a block's `<code>` element's `innerText` while the element carries
    `data-md-copying` (which hides code annotations), with trailing whitespace trimmed.
    """
    site = built_site.require()
    checked = 0
    for path in sorted(site.rglob("index.html")):
        if path.parent.name in ("reference", "examples") or "reference" in path.parts:
            continue
        expected = [block.text for block in html_blocks(path.read_text(encoding="utf-8"))]
        if not expected:
            continue
        url = (site_url + path.parent.relative_to(site).as_posix() + "/").replace("/./", "/")
        page.goto(url)
        # A reader opens a folded block (`??? info`) before copying from it.
        page.evaluate("document.querySelectorAll('details').forEach(d => { d.open = true; })")
        copied = page.evaluate(
            "Array.from(document.querySelectorAll('.language-python.highlight code')).map(c => {"
            " c.setAttribute('data-md-copying', ''); const text = c.innerText.trimEnd();"
            " c.removeAttribute('data-md-copying'); return text; })"
        )
        assert copied == expected, url
        checked += len(expected)
    assert checked >= 10


# A page a reader scrolls through at 1280 px wide: past this, its reference parts are folded
# (`??? info`), or it is split.
MAX_PAGE_HEIGHT_PX = 8000


def test_no_page_is_taller_than_8000_px_at_1280_wide(page, site_url: str, built_site: BuiltSite):
    site = built_site.require()
    page.call(
        "Emulation.setDeviceMetricsOverride",
        width=1280,
        height=900,
        deviceScaleFactor=1,
        mobile=False,
    )
    heights = {}
    try:
        for path in sorted(site.rglob("index.html")):
            parts = path.parent.relative_to(site).parts
            if parts and parts[0] in ("reference", "examples"):
                continue  # generated: the API reference and the example scripts, in full
            url = (site_url + path.parent.relative_to(site).as_posix() + "/").replace("/./", "/")
            page.goto(url)
            page.wait_for("document.querySelectorAll('pre.mermaid').length === 0", timeout_s=30)
            heights[url.removeprefix(site_url) or "/"] = page.evaluate(
                "document.documentElement.scrollHeight"
            )
    finally:
        page.call("Emulation.clearDeviceMetricsOverride")
    assert len(heights) > 20
    tall = {url: px for url, px in heights.items() if px > MAX_PAGE_HEIGHT_PX}
    assert not tall, f"pages taller than {MAX_PAGE_HEIGHT_PX} px at 1280 wide: {tall}"
