"""docs/metrics.md lists exactly what `GET /metrics` exports: each name, its type, its labels."""

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from weightsync import AsyncEngine, EngineConfig
from weightsync.serve import ServerConfig, create_app

PAGE = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
MARKER = "<!-- metrics-check: names -->"
# Every sample has these; the page says so once instead of on every row.
COMMON_LABELS = {"model_name", "engine"}
# A histogram's own sample labels and suffixes (Prometheus's, not the metric's).
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _page_rows() -> dict[str, tuple[str, frozenset[str]]]:
    """`{name: (type, labels beyond the common ones)}` of the table after the page's marker."""
    lines = PAGE.read_text(encoding="utf-8").split(MARKER, 1)[1].strip().splitlines()
    rows = {}
    for line in lines[2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        name, kind, labels = (cell.strip() for cell in line.strip("|").split("|")[:3])
        rows[name.strip("`")] = (kind, frozenset(c.strip(" `") for c in labels.split(",") if c))
    return rows


def _exported() -> dict[str, tuple[str, frozenset[str]]]:
    """The same, read from a server's `/metrics` once every kind of event has been counted."""
    engine = AsyncEngine("debug", engine_config=EngineConfig(num_kv_blocks=64))
    with TestClient(create_app(engine, ServerConfig(model_name="debug"))) as client:
        client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        client.post("/pause", params={"mode": "keep"})
        client.post("/resume")
        client.post("/start_weight_update", json={})
        client.post("/finish_weight_update", json={"weight_version": "step-1"})
        text = client.get("/metrics").text
    exported = {}
    for family in text_string_to_metric_families(text):
        labels: set[str] = set()
        exposed = family.name
        for sample in family.samples:
            labels |= set(sample.labels) - COMMON_LABELS - {"le"}
            if family.type != "histogram":
                exposed = sample.name  # a counter's family drops `_total`; its samples keep it
        assert family.samples, f"{family.name} has no sample after the scrape's events"
        exported[exposed] = (family.type, frozenset(labels))
    return exported


def test_the_metrics_page_lists_every_exported_metric_with_its_type_and_labels():
    assert _page_rows() == _exported()


def test_every_sample_carries_the_common_labels():
    engine = AsyncEngine("debug", engine_config=EngineConfig(num_kv_blocks=64))
    with TestClient(create_app(engine, ServerConfig(model_name="debug"))) as client:
        text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) >= COMMON_LABELS, sample
