"""Command line: `shardproof verify CASE.py [--world-size N] [--json PATH] [--preset NAME] [--train [--step]]`
(or `verify --hf CONFIG.json [--tp-plan PLAN.json]` instead of a case file) and
`shardproof verify-graphs --reference R --distributed D [--format hlo|fx] [--relations FILE] [--json PATH]`."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import TYPE_CHECKING

from shardproof.errors import CaseError, ShardproofError

if TYPE_CHECKING:
    from shardproof.case import Case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardproof", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify_cmd = commands.add_parser("verify", help="prove a case file's distributed model equals its reference")
    verify_cmd.add_argument("case", nargs="?", help="path of the case file")
    verify_cmd.add_argument("--hf", metavar="CONFIG",
                            help="instead of a case file: a transformers config.json, parallelised by transformers' own TP")
    verify_cmd.add_argument("--tp-plan", metavar="PLAN", help="with --hf: a JSON file of TP plan entries overriding the model's")
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
    if args.command == "verify" and (args.case is None) == (args.hf is None):
        parser.error("verify needs a case file or --hf CONFIG (one of them)")
    if args.command == "verify" and args.tp_plan and not args.hf:
        parser.error("--tp-plan goes with --hf")

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
                args.case if args.hf is None else _transformers_case(args),
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


def _transformers_case(args: argparse.Namespace) -> Case:
    """The case of a transformers config file (`--hf`), TP applied by transformers' own code."""
    try:
        from shardproof.integrations.transformers import load_tp_plan, transformers_case
    except ImportError as err:
        raise CaseError(str(err)) from err
    plan = load_tp_plan(args.tp_plan) if args.tp_plan else None
    return transformers_case(args.hf, tp_plan=plan, world_size=args.world_size or 2, train=args.train)


if __name__ == "__main__":
    sys.exit(main())
