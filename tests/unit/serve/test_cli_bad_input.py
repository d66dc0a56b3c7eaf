"""Bad `weightsync serve` flags, table-driven: each exits with a status and one line saying why.

`main` runs in this process, so a flag that slipped through to a traceback fails the test with
that traceback; serving is replaced by a failure, so a flag wrongly accepted cannot hang it.
tests/integration/test_serve_bad_input.py runs two of these through the real command.
"""

from __future__ import annotations

import socket

import pytest

import weightsync.serve._server as server_module
from weightsync.serve.cli import main

pytestmark = pytest.mark.reliability("bad-input")

# (id, flags after `serve`, exit status, text of the error line)
CASES = [
    ("unknown-flag", ["debug", "--bogus"], 2, "unrecognized arguments: --bogus"),
    ("port-not-int", ["debug", "--port", "eighty"], 2, "expected an integer, got 'eighty'"),
    ("port-too-large", ["debug", "--port", "70000"], 2, "expected a port in [0, 65535]"),
    ("port-negative", ["debug", "--port", "-5"], 2, "expected a port in [0, 65535]"),
    ("max-num-seqs-zero", ["debug", "--max-num-seqs", "0"], 2, "expected an integer >= 1, got 0"),
    ("num-kv-blocks-text", ["debug", "--num-kv-blocks", "many"], 2, "expected an integer"),
    ("max-request-bytes-zero", ["debug", "--max-request-bytes", "0"], 2, "expected an integer >= 1"),
    ("dtype-unknown", ["debug", "--dtype", "int8"], 2, "invalid choice: 'int8'"),
    ("load-format-unknown", ["debug", "--load-format", "pickle"], 2, "invalid choice: 'pickle'"),
    ("log-level-unknown", ["debug", "--log-level", "loud"], 2, "invalid choice: 'loud'"),
    ("seed-too-large", ["debug", "--seed", str(2**70)], 2, "expected a seed in [-2**63, 2**64)"),
    ("sampling-seed-too-small", ["debug", "--sampling-seed", str(-(2**64))], 2, "expected a seed"),
    ("worker-index-negative", ["debug", "--worker-index", "-1"], 2, "expected an integer >= 0"),
    ("device-meta", ["debug", "--device", "meta"], 2, "'cpu' or 'cuda' devices only"),
    ("device-unknown", ["debug", "--device", "tpu"], 2, "EngineConfig.device must name a torch device"),
    ("model-missing", ["/nonexistent/model"], 2, "has no config.json"),
    ("max-model-len-one", ["debug", "--max-model-len", "1"], 2, "max_model_len must be an int >= 2"),
    ("max-model-len-past-model", ["debug", "--max-model-len", "100000"], 2, "max_model_len"),
    ("budget-below-seqs", ["debug", "--max-num-batched-tokens", "4", "--max-num-seqs", "8"], 2,
     "max_num_batched_tokens (4) must be >= max_num_seqs (8)"),
    ("transfer-config-bad-json", ["debug", "--weight-transfer-config", "{bad"], 2,
     "must be a JSON object like"),
    ("transfer-config-not-object", ["debug", "--weight-transfer-config", "[1]"], 2,
     "must be a JSON object, got"),
    ("transfer-backend-unknown", ["debug", "--weight-transfer-config.backend", "pigeon"], 2,
     "unknown weight transfer backend"),
    ("host-public-without-admin-key", ["debug", "--host", "0.0.0.0"], 2, "--admin-api-key"),
    ("host-unresolvable-without-admin-key", ["debug", "--host", "no.such.host.invalid"], 2,
     "not a loopback address"),
    ("admin-key-two-lines", ["debug", "--admin-api-key", "two\nlines"], 2,
     "admin_api_key cannot travel in an HTTP header"),
    ("api-key-padded", ["debug", "--api-key", " padded "], 2,
     "api_key cannot travel in an HTTP header"),
]  # fmt: skip


@pytest.fixture
def no_serving(monkeypatch):
    def serve_forever(*args, **kwargs):
        raise AssertionError("the command accepted its flags and would serve")

    monkeypatch.setattr(server_module, "serve_forever", serve_forever)
    monkeypatch.delenv("WEIGHTSYNC_ADMIN_API_KEY", raising=False)


def run(argv: list[str]) -> int:
    try:
        return main(["serve", *argv])
    except SystemExit as exc:  # argparse exits itself
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("flags", "status", "message"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_bad_flag_exits_with_one_line(
    no_serving, capsys, flags, status, message, record_property
):
    """A bad `weightsync serve` flag: the exit status, and one error line naming it."""
    assert run(flags) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1, err
    assert message in error_lines[0]
    record_property("exit_status", status)
    record_property("message", error_lines[0][:160])


def test_a_taken_port_exits_with_one_line(no_serving, capsys, record_property):
    """A port another process listens on: exit status 1 and one line naming the address."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run(["debug", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err
    record_property("exit_status", 1)
