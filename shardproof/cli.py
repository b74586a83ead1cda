"""Command line: `shardproof verify CASE.py [--world-size N] [--json PATH] [--preset NAME] [--train [--step]]`
and `shardproof verify-graphs --reference R --distributed D [--format hlo|fx] [--relations FILE] [--json PATH]`."""

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
    verify_cmd.add_argument("--quiet", action="store_true", help="no progress display")
    verify_cmd.add_argument(
        "--backend",
        choices=("local", "ray", "none"),
        default="local",
        help="where ranks are traced: local process pool when it pays off (default), a Ray cluster, or this process",
    )
    verify_cmd.add_argument("--ray-address", help="Ray cluster to use with --backend ray (default: RAY_ADDRESS)")
    graphs_cmd = commands.add_parser(
        "verify-graphs", help="prove graph dumps (XLA HLO text, FX readable dumps) of a distributed program equal the reference's"
    )
    graphs_cmd.add_argument("--reference", required=True, help="reference graph: a file or a directory")
    graphs_cmd.add_argument("--distributed", required=True, help="distributed graphs: one SPMD file, or a directory with one file per rank")
    graphs_cmd.add_argument("--format", choices=["hlo", "fx"], help="graph format (default: detected from the files)")
    graphs_cmd.add_argument("--relations", metavar="FILE", help="JSON pinning some input relations by hand (see README)")
    graphs_cmd.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    graphs_cmd.add_argument("--quiet", action="store_true", help="no progress display")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    from shardproof.api import verify  # torch import is slow: after argument errors are reported
    from shardproof.importers.verify import verify_graphs
    from shardproof.report.progress import RichProgress
    from shardproof.report.text import render

    progress = RichProgress()
    try:
        quiet = (lambda _: None) if args.quiet else progress
        if args.command == "verify-graphs":
            report = verify_graphs(args.reference, args.distributed, format=args.format, relations=args.relations, progress=quiet)
        else:
            report = verify(
                args.case,
                world_size=args.world_size,
                preset=args.preset,
                train=args.train,
                step=args.step,
                progress=quiet,
                backend=args.backend,
                ray_address=args.ray_address,
            )
    except ShardproofError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    print(render(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report.to_json(), handle, indent=2)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
