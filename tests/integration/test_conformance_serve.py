"""`weightsync conformance` against `weightsync serve`: the server keeps vLLM's contract.

The command is run as a user runs it, against a real server (with a transfer backend, as vLLM
needs one for its weight-update routes); every case passes or is skipped for a reason the report
gives (no keys given).
"""

import json
import os
import subprocess
import sys

from serve_support import SRC, Server


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
