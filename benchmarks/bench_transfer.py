"""Transfer benchmark: weightsync against its baselines, measured in one run, printed as JSON.

    python benchmarks/bench_transfer.py --backend gloo --json
    python benchmarks/bench_transfer.py --backend ipc --json
    python benchmarks/bench_transfer.py --staging --json   (an engine's update, staged or not)
    python benchmarks/bench_transfer.py --backend gloo --via http --json

The last line of output is one JSON object with the figures and their ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["gloo", "ipc"], default="gloo")
    parser.add_argument(
        "--size-mb", type=int, default=1024, help="model size in MiB (default ~1 GiB)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed repetitions per figure (best is kept)"
    )
    parser.add_argument(
        "--staging",
        action="store_true",
        help="measure an engine's update with and without weight_update_staging instead",
    )
    parser.add_argument(
        "--via",
        choices=["direct", "http"],
        default="direct",
        help="http: a whole sync through a live weightsync serve against the bare transfer",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    if args.staging:
        from transfer_staging import run
    elif args.via == "http":
        if args.backend != "gloo":
            parser.error("--via http measures the gloo backend")
        from transfer_http import run
    elif args.backend == "gloo":
        from transfer_broadcast import run
    else:
        from transfer_ipc import run
    result = run(size_mb=args.size_mb, repeats=args.repeats, verbose=not args.json)
    result["machine"] = describe_machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
