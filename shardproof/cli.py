"""The command line. Exit codes: 0 equivalent, 1 discrepancy (proven), 2 unknown or unusable input,
3 internal error (a bug in shardproof; `--debug` shows its traceback).

Only the standard library is imported before the arguments are read: torch is imported by the
command that needs it, so `--help` and `--version` answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

EXIT_USAGE = 2  # unusable input, as argparse's own usage errors
EXIT_INTERNAL = 3
FORMATS = ("text", "github", "sarif")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve()
    if args.command == "verify" and (args.case is None) == (args.hf is None):
        parser.error("verify needs a case file or --hf CONFIG (one of them)")
    if args.command == "verify" and args.tp_plan and not args.hf:
        parser.error("--tp-plan goes with --hf")
    from shardproof.errors import ShardproofError

    try:
        if args.command == "init":
            from shardproof.init import write_template

            return write_template(args.path, args.model, args.force)
        _check_paths(args)
    except ShardproofError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    from shardproof import serve

    forwarded = serve.forward(sys.argv[1:] if argv is None else argv, serve.socket_path(_version()))
    return _verify(args) if forwarded is None else forwarded


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardproof",
        description="Prove a distributed model computes what its single-device reference does, or name the line "
        "that breaks it.",
        epilog="exit codes: 0 equivalent, 1 discrepancy, 2 unknown or unusable input, 3 internal error",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    common.add_argument("--html", metavar="PATH", help="also write the report as one self-contained HTML page to PATH")
    common.add_argument("--quiet", action="store_true", help="no progress display")
    common.add_argument("--debug", action="store_true", help="show the traceback of an internal error")

    verify_cmd = commands.add_parser("verify", parents=[common], help="prove a case file's distributed model equals its reference")
    verify_cmd.add_argument("case", nargs="?", help="path of the case file")
    verify_cmd.add_argument("--hf", metavar="CONFIG",
                            help="instead of a case file: a transformers config.json, parallelised by transformers' own TP")
    verify_cmd.add_argument("--tp-plan", metavar="PLAN", help="with --hf: a JSON file of TP plan entries overriding the model's")
    verify_cmd.add_argument("--format", "--output-format", dest="output_format", choices=FORMATS, default="text",
                            help="how stdout shows the report: text (default), github (workflow annotations at the "
                            "culprit lines), sarif (SARIF 2.1.0)")
    verify_cmd.add_argument("--world-size", type=_world_size, default=None, help="number of ranks (default: the case's WORLD_SIZE)")
    verify_cmd.add_argument("--preset", help="use the case file's PRESETS[NAME] as its CONFIG")
    verify_cmd.add_argument("--train", action="store_true",
                            help="prove one training step: the loss and every gradient (needs loss() in the case)")
    verify_cmd.add_argument("--step", action="store_true", help="with --train: also the parameters after one optimizer step")
    verify_cmd.add_argument(
        "--backend",
        choices=("local", "ray", "none"),
        default="local",
        help="where ranks are traced: local process pool when it pays off (default), a Ray cluster, or this process",
    )
    verify_cmd.add_argument("--ray-address", help="Ray cluster to use with --backend ray (default: RAY_ADDRESS)")

    graphs_cmd = commands.add_parser(
        "verify-graphs", parents=[common],
        help="prove graph dumps (XLA HLO text, FX readable dumps) of a distributed program equal the reference's",
    )
    graphs_cmd.add_argument("--reference", required=True, help="reference graph: a file or a directory")
    graphs_cmd.add_argument("--distributed", required=True, help="distributed graphs: one SPMD file, or a directory with one file per rank")
    graphs_cmd.add_argument("--format", choices=["hlo", "fx"], help="graph format (default: detected from the files)")
    graphs_cmd.add_argument("--relations", metavar="FILE", help="JSON pinning some input relations by hand (see README)")
    graphs_cmd.add_argument("--output-format", choices=FORMATS, default="text", help="as verify's --format")

    commands.add_parser(
        "serve", help="keep torch and the frameworks imported: later verify commands (any terminal, same Python) "
        "start in a fraction of a second; Ctrl-C stops it",
    )

    init_cmd = commands.add_parser("init", help="write a commented case file to start from")
    init_cmd.add_argument("path", nargs="?", default="case.py", help="where to write it (default: case.py)")
    init_cmd.add_argument("--model", metavar="PKG.MODULE:CLASS", help="a torch.nn.Module class to build the case around")
    init_cmd.add_argument("--force", action="store_true", help="overwrite an existing file")
    return parser


def _serve() -> int:
    from shardproof import serve

    try:
        serve.serve(serve.socket_path(_version()), main, lambda line: print(line, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        pass
    return 0


def _version() -> str:
    try:
        return metadata.version("shardproof")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of ranks, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _check_paths(args: argparse.Namespace) -> None:
    """Before any work (and before torch is imported): the inputs exist, and every output file can
    be written, so that a run never ends in a failed write."""
    from shardproof.errors import UsageError
    from shardproof.paths import case_file

    if args.command == "verify" and args.case is not None:
        case_file(args.case)
    for option in ("reference", "distributed", "relations") if args.command == "verify-graphs" else ():
        target = getattr(args, option)
        if target is not None and not Path(target).exists():
            raise UsageError(f"--{option} {target}: not found")
    for option in ("json", "html"):
        target = getattr(args, option)
        if target is None:
            continue
        path = Path(target)
        if path.is_dir():
            raise UsageError(f"--{option} {target}: is a directory; give a file path")
        if not path.parent.is_dir():
            raise UsageError(f"--{option} {target}: directory {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise UsageError(f"--{option} {target}: not writable")


def _verify(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from shardproof.report.progress import RichProgress

    phase = _Phase(None if args.quiet else RichProgress())
    try:
        try:
            with _user_output_to_stderr():
                report = _run_command(args, phase)
        finally:
            phase.close()
        _write(report, args)
    except Exception as err:  # noqa: BLE001 - every failure gets its exit code and one line
        return _failed(err, phase.current, args.debug)
    return report.exit_code


def _run_command(args: argparse.Namespace, progress: Callable[[str], None]) -> Any:
    if args.command == "verify-graphs":
        from shardproof.importers.verify import verify_graphs

        return verify_graphs(args.reference, args.distributed, format=args.format, relations=args.relations, progress=progress)
    from shardproof.api import verify

    case = args.case if args.hf is None else _transformers_case(args)
    return verify(case, world_size=args.world_size, preset=args.preset, train=args.train, step=args.step,
                  progress=progress, backend=args.backend, ray_address=args.ray_address)


def _transformers_case(args: argparse.Namespace) -> Any:
    """The case of a transformers config file (`--hf`), TP applied by transformers' own code."""
    from shardproof.errors import CaseError

    try:
        from shardproof.integrations.transformers import load_tp_plan, transformers_case
    except ImportError as err:
        raise CaseError(str(err)) from err
    plan = load_tp_plan(args.tp_plan) if args.tp_plan else None
    return transformers_case(args.hf, tp_plan=plan, world_size=args.world_size or 2, train=args.train)


def _write(report: Any, args: argparse.Namespace) -> None:
    from shardproof.report import ci
    from shardproof.report.text import render

    print({"text": render, "github": ci.github, "sarif": ci.sarif}[args.output_format](report))
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.html:
        from shardproof.report.html import page

        Path(args.html).write_text(page(report))


def _failed(err: Exception, phase: str, debug: bool) -> int:
    """Unusable input: exit 2 with its message. Anything else is a bug in shardproof: exit 3, one
    line saying what failed, the traceback only under `--debug`."""
    from shardproof.errors import ShardproofError

    if isinstance(err, ShardproofError):
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if debug:
        traceback.print_exception(err)
    message = (str(err).strip().splitlines() or [""])[0]
    advice = "please report it with the traceback above" if debug else "rerun with --debug for the traceback"
    print(f"internal error while {phase}: {type(err).__name__}: {message} -- a bug in shardproof, not in the input; "
          f"{advice}", file=sys.stderr)
    return EXIT_INTERNAL


class _Phase:
    """What the run is doing, to say what failed; forwards to the progress display unless quiet."""

    def __init__(self, display: Any) -> None:
        self.display = display
        self.current = "starting"

    def __call__(self, message: str) -> None:
        self.current = message
        if self.display is not None:
            self.display(message)

    def show_count(self, what: str, done: int, total: int, reused: int = 0) -> None:
        if self.display is not None:
            self.display.show_count(what, done, total, reused)

    def close(self) -> None:
        if self.display is not None:
            self.display.close()


@contextlib.contextmanager
def _user_output_to_stderr() -> Iterator[None]:
    """What the user's code prints while shardproof runs it (on fake tensors, on random weights, in
    worker processes) goes to stderr: stdout carries the report alone, for the formats tools read."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1: Python's stream alone is redirected
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


if __name__ == "__main__":
    sys.exit(main())
