"""The answers docs/serving.md shows are what `weightsync serve tiny` answers, as pasted.

The page's sample `/v1/completions` answer is compared with a fresh server's (all but the id and
the time; log-probabilities to the page's two places), and its RL-routes curl block is run by bash
with `curl` against the server: every call must answer 200.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_support import Server

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
ADMIN_KEY = "docs-admin-key"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _fences() -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in _FENCE.finditer(PAGE.read_text(encoding="utf-8"))]


def _after(predicate: Any) -> tuple[str, str | None]:
    """The first bash block matching `predicate`, and the JSON block right after it."""
    fences = _fences()
    for i, (lang, text) in enumerate(fences):
        if lang == "bash" and predicate(text):
            following = fences[i + 1] if i + 1 < len(fences) else ("", "")
            return text, following[1] if following[0] == "json" else None
    raise AssertionError(f"no such bash block on {PAGE.name}")


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items() if k not in ("id", "created")}
    return value


@pytest.fixture(scope="module")
def server():
    # The page's command, with an admin key so that its curl block's header is checked.
    server = Server(
        "tiny",
        "--port",
        "0",
        "--weight-transfer-config",
        '{"backend": "gloo"}',
        "--admin-api-key",
        ADMIN_KEY,
    )
    yield server
    server.stop()


def test_the_sample_completion_is_the_tiny_models_answer(server):
    command, shown = _after(lambda text: "/v1/completions" in text and '"logprobs"' in text)
    assert shown is not None, "the completions request is not followed by its answer"
    body = re.search(r"-d '(.+?)'", command, re.DOTALL)
    assert body is not None, command
    answer = httpx.post(
        f"{server.base_url}/v1/completions", json=json.loads(body[1]), timeout=60
    ).json()
    assert _rounded(answer) == _rounded(json.loads(shown))


def test_the_rl_routes_curl_block_runs_as_pasted(server):
    if shutil.which("curl") is None or shutil.which("bash") is None:
        pytest.skip("needs curl and bash: the block is run as a reader pastes it")
    block, _ = _after(lambda text: "/finish_weight_update" in text)
    port = server.base_url.rsplit(":", 1)[1]
    # Each curl prints its status after its body, so a refusal cannot pass unseen.
    script = "set -eu\n" + block.replace("localhost:8000", f"127.0.0.1:{port}").replace(
        "curl -s", "curl -s -w ' %{http_code}\\n'"
    )
    result = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "ADMIN_KEY": ADMIN_KEY},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    statuses = re.findall(r" (\d{3})$", result.stdout, re.MULTILINE)
    assert len(statuses) == block.count("curl -s"), result.stdout
    assert set(statuses) == {"200"}, result.stdout
    assert result.stdout.rstrip().endswith('{"weight_version":"step-7"} 200'), result.stdout
