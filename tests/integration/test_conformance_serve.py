"""`weightsync conformance` against `weightsync serve`: the server keeps vLLM's contract.

The command is run as a user runs it, against a real server (with a transfer backend, as vLLM
needs one for its weight-update routes); every case passes or is skipped for a reason the report
gives (no keys given).
"""

import json
import os
import subprocess
import sys

import httpx
from serve_support import SRC, Server

from weightsync.conformance import run_conformance


def test_weightsync_serve_passes_the_conformance_check():
    server = Server("debug", "--port", "0", "--num-kv-blocks", "256",
                    "--weight-transfer-config.backend", "gloo")  # fmt: skip
    try:
        run = subprocess.run(
            [sys.executable, "-m", "weightsync.serve.cli", "conformance", server.base_url, "--json"],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "PYTHONPATH": str(SRC)},
        )  # fmt: skip
        report = json.loads(run.stdout)
        failed = {c["name"]: c["detail"] for c in report["cases"] if c["outcome"] == "failed"}
        assert not failed, failed
        assert run.returncode == 0, run.stderr[-2000:]
        skipped = {c["name"] for c in report["cases"] if c["outcome"] == "skipped"}
        assert skipped <= {"auth.admin_key_required", "auth.api_key_required"}, skipped
        assert report["summary"]["passed"] >= 70
    finally:
        server.stop()
        server.kill()


def test_a_paused_torn_server_is_reported_as_such_before_any_case():
    """A level-2 sleep, woken, leaves the server paused with torn weights (as an earlier run of
    the check leaves it): the report says so first, instead of failing case after case."""
    server = Server("debug", "--port", "0", "--num-kv-blocks", "256")
    try:
        for path in ("/sleep?level=2", "/wake_up"):
            assert httpx.post(server.base_url + path, timeout=60).status_code == 200
        report = run_conformance(server.base_url, timeout_s=30)
        first, *rest = report.cases
        assert (first.name, first.outcome) == ("server.ready", "failed")
        assert "paused" in first.detail and "torn" in first.detail
        assert "level-2 sleep" in first.detail and "restart it" in first.detail
        assert {r.outcome for r in rest} == {"skipped"}
        assert all(r.detail.startswith("server.ready failed") for r in rest)
        assert not report.ok
    finally:
        server.stop()
        server.kill()


def test_the_core_never_imports_the_kit():
    # The kit is not on the path of an update: the package, its trainer side and the server's
    # app and command load without it (the command imports it only to run `conformance`).
    probe = (
        "import sys, weightsync, weightsync.trainer, weightsync.serve.app, weightsync.serve.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('weightsync.conformance')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )  # fmt: skip
    assert loaded.stdout.strip() == "[]"
