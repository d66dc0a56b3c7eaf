"""Records `weightsync conformance URL` against a server, with the machine it ran on.

    python benchmarks/record_conformance.py http://127.0.0.1:PORT > benchmarks/results/vllm/conformance.json

The last line of output is one JSON object: the check's report (`server` holds what the server
says of itself, e.g. `/version`), plus `machine` (`benchmarks/machine.py`), the load average
at the end and the command line of the server under test when `--server-command` gives it.
The check overwrites the served weights at its end (see `weightsync.conformance`).
"""

from __future__ import annotations

import argparse
import json
import os

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync.conformance import run_conformance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", help="the server's base URL")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="bound of each call")
    parser.add_argument("--server-command", default=None,
                        help="how the server was started, recorded as given")  # fmt: skip
    args = parser.parse_args()
    report = run_conformance(args.url, timeout_s=args.timeout_s)
    result = {
        "benchmark": "conformance",
        **report.to_dict(),
        "server_command": args.server_command,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "machine": describe_machine(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
