"""docs/openapi.json is the server's schema: every route and operation, as the app publishes them."""

import json
from pathlib import Path

from weightsync import AsyncEngine, EngineConfig
from weightsync.serve import ServerConfig, create_app

DOCS_SCHEMA = Path(__file__).resolve().parents[3] / "docs" / "openapi.json"


def operations(schema):
    return {
        (path, method, spec.get("operationId"))
        for path, methods in schema["paths"].items()
        for method, spec in methods.items()
    }


def test_the_documented_schema_is_the_servers():
    # With LoRA enabled: the schema documents every route, the LoRA ones included.
    engine = AsyncEngine("debug", engine_config=EngineConfig(enable_lora=True))
    current = create_app(engine, ServerConfig()).openapi()
    documented = json.loads(DOCS_SCHEMA.read_text())
    assert operations(documented) == operations(current), (
        "docs/openapi.json is stale: regenerate it from create_app(...).openapi() of an engine "
        "with EngineConfig(enable_lora=True), as json.dumps(schema, indent=2, sort_keys=True)"
    )
    assert set(documented["components"]["schemas"]) == set(current["components"]["schemas"])
