"""Command line: `shardproof verify CASE.py [--world-size N] [--json PATH] [--preset NAME] [--train [--step]]`."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from shardproof.errors import ShardproofError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardproof", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify_cmd = commands.add_parser("verify", help="prove a case file's distributed model equals its reference")
    verify_cmd.add_argument("case", help="path of the case file")
    verify_cmd.add_argument("--world-size", type=int, default=None, help="number of ranks (default: the case's WORLD_SIZE)")
    verify_cmd.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    verify_cmd.add_argument("--preset", help="use the case file's PRESETS[NAME] as its CONFIG")
    verify_cmd.add_argument("--train", action="store_true",
                            help="prove one training step: the loss and every gradient (needs loss() in the case)")
    verify_cmd.add_argument("--step", action="store_true",
                            help="with --train: also the parameters after one optimizer step")
    verify_cmd.add_argument("--quiet", action="store_true", help="no progress messages")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    from shardproof.api import verify  # torch import is slow: after argument errors are reported
    from shardproof.report.text import render

    progress = (lambda _: None) if args.quiet else (lambda msg: print(f"  … {msg}", file=sys.stderr, flush=True))
    try:
        report = verify(args.case, world_size=args.world_size, preset=args.preset, train=args.train,
                        step=args.step, progress=progress)
    except ShardproofError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report.to_json(), handle, indent=2)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
