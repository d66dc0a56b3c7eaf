"""schemathesis against the server's own OpenAPI schema: no generated request gets a 5xx.

Every operation of the server's schema (`docs/openapi.json`, which a unit test keeps equal to what
the app publishes at `/openapi.json`) gets a fixed number of generated requests, valid and
invalid, against one `weightsync serve`. Each must be answered below 500 (a refusal is fine; a 500 is a
failure the server did not know how to name). Before each request, any pause or update the
previous one left is ended, so a completion never waits on a pause another case made. A last
test checks that the server still serves.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from serve_support import Server

pytestmark = pytest.mark.reliability("schema")

MAX_EXAMPLES = 15
"""Generated requests per operation: about 20 operations, under a minute in all."""


@pytest.fixture(scope="module")
def server():
    # Short sequences and few of them: a generated completion asking for the most of everything
    # still ends in well under a second.
    # With LoRA enabled, so that its routes (in the schema) are served too.
    server = Server("debug", "--port", "0", "--num-kv-blocks", "64", "--max-model-len", "48",
                    "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                    "--enable-lora")  # fmt: skip
    yield server
    server.stop()
    server.kill()


# Loaded from the file at import, not from the server through a fixture: schemathesis's lazy
# fixture schemas reach into pytest's private node attributes, which pytest 9.2 removed.
schema = schemathesis.openapi.from_path(
    Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
)


@pytest.fixture(scope="module")
def control(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def _settle(control: httpx.Client) -> None:
    """Ends whatever pause or update earlier requests left (both harmless otherwise)."""
    control.post("/abort_weight_update")
    control.post("/resume")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,  # the bound is MAX_EXAMPLES and each call's timeout
    database=None,
    derandomize=True,  # the same requests on every run
    suppress_health_check=list(HealthCheck),
)
def test_no_generated_request_gets_a_server_error(case, server, control, record_property):
    """Generated requests for one operation of the schema: every answer is below 500."""
    # A completion (or a token generation) queued behind a pause would wait it out.
    if case.path.startswith(("/v1/", "/inference/")):
        _settle(control)
    response = case.call(base_url=server.base_url, timeout=30)
    assert response.status_code < 500, (case.method, case.path, response.text[:500])
    record_property("max_examples", MAX_EXAMPLES)


def test_the_server_still_serves_afterwards(server, control):
    """After every generated request: /health answers, and a completion runs to its end."""
    _settle(control)
    assert server.proc.poll() is None
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200
    assert len(answer.json()["choices"][0]["token_ids"]) == 4
