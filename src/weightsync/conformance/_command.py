"""`weightsync conformance URL`: runs the check and prints the table, or one JSON object."""

from __future__ import annotations

import argparse
import json

from weightsync.conformance import run_conformance


def run_command(args: argparse.Namespace) -> int:
    """Runs the check as the command line asks; returns 0 when no case failed, else 1."""
    report = run_conformance(
        args.url,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        timeout_s=args.timeout_s,
        keep_weights=args.keep_weights,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 0 if report.ok else 1
