"""Mutation suite: does shardproof find every fault we plant, and at the line we planted it?

Each mutant is one small change to the code the distributed side of a case file runs (mutants.py).
Its truth comes from running it for real, one gloo process per rank, in float64 (gloo_truth.py);
shardproof's verdict from `shardproof.verify` in this process. Every mutant falls in one row:

  killed             really differs, shardproof says discrepancy
  unsound            really differs, shardproof says equivalent (must be 0)
  unknown            really differs, shardproof says unknown
  unusable-but-runs  really differs, shardproof calls the input unusable (exit 2)
  false              same numbers, shardproof says discrepancy (must be 0)
  equivalent-mutant  same numbers, shardproof proves it equivalent
  unproven           same numbers, shardproof says unknown or unusable
  crash              shardproof raised an internal error (a traceback; must be 0)
  raises/unusable    the program raises on some rank, shardproof calls it unusable input (right)
  raises/verdict     the program raises on some rank, shardproof gave a verdict anyway
  no truth           the unmutated case does not run the same under gloo (pipeline p2p, say): not judged

Localisation, among the killed: the first distributed site shardproof reports is on the line the
programmer has to change (or within 3 lines of it): the mutated line, or for a deleted collective
the op that made the value it should have reduced (fault_lines.py).

    python bench/mutate.py --n 300 --seed 1
    python bench/mutate.py tests/cases/missing-allreduce_fixed.py --n 20 --details
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from fault_lines import fault_lines
from gloo_truth import GlooRanks, Truth, forget_case_modules
from mutants import Mutant, all_mutants

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("killed", "unsound", "unknown", "unusable-but-runs", "false", "equivalent-mutant", "unproven", "crash",
        "raises/unusable", "raises/verdict", "no truth")
NEAR = 3  # lines


@dataclass
class Outcome:
    mutant: str
    operator: str
    truth: str
    truth_detail: str
    verdict: str  # equivalent | discrepancy | unknown | unusable | crash
    detail: str
    row: str
    site: str = ""  # the first distributed site reported: file:line
    on_line: bool = False
    near: bool = False
    seconds: float = 0.0


def default_cases() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "tests" / "cases").glob("*_fixed.py"))


def choose(paths: list[Path], n: int, seed: int) -> list[Mutant]:
    """`n` mutants drawn without replacement by `seed`, in source order."""
    every = list(all_mutants(paths))
    picked = random.Random(seed).sample(range(len(every)), min(n, len(every)))
    return [every[i] for i in sorted(picked)]


def run(mutants: list[Mutant], world_size: int, timeout: float, progress: bool = True) -> list[Outcome]:
    folders = sorted({str(m.path.parent) for m in mutants})
    sys.path[:0] = folders  # a mutant in a scratch folder still imports its siblings
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch, GlooRanks(world_size, folders) as ranks:
        originals: dict[Path, Truth] = {}
        for index, mutant in enumerate(mutants):
            if mutant.path not in originals:
                originals[mutant.path] = ranks.run(mutant.path, None)
            if originals[mutant.path].status != "same":  # gloo cannot run the case as written: no truth
                outcomes.append(Outcome(mutant.describe(), mutant.operator, "none", originals[mutant.path].detail,
                                        "", "", "no truth"))
                continue
            folder = Path(scratch) / f"m{index}"
            folder.mkdir()
            path = folder / mutant.path.name
            path.write_text(mutant.source(mutant.path.read_text()))
            start = time.perf_counter()
            truth = ranks.run(path, None)
            searched = [str(folder), *folders]
            verdict = shardproof_verdict(path, world_size, timeout, searched)
            lines = set(range(mutant.line, mutant.end_line + 1))
            if truth.status == "differs" and verdict[0] == "discrepancy":
                with _isolated(searched):
                    lines = fault_lines(mutant.operator, range(mutant.line, mutant.end_line + 1), mutant.path, path,
                                        world_size)
            outcome = judge(mutant, truth, *verdict, lines)
            outcome.seconds = time.perf_counter() - start
            outcomes.append(outcome)
            if progress:
                print(f"[{index + 1}/{len(mutants)}] {outcome.row:18} {outcome.seconds:5.1f}s {outcome.mutant}",
                      file=sys.stderr, flush=True)
    return outcomes


def shardproof_verdict(path: Path, world_size: int, timeout: float, folders: list[str]) -> tuple[str, str, str]:
    """(verdict, diagnosis or error, first distributed site) of shardproof on the mutant."""
    from shardproof.api import verify
    from shardproof.errors import ShardproofError

    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(int(timeout))
    try:
        with _isolated(folders):
            report = verify(path, world_size=world_size, backend="none")
        site = next((f"{s.file}:{s.line}" for s in report.distributed), "")
        return report.verdict, report.diagnosis or "", site
    except ShardproofError as err:
        return "unusable", str(err), ""
    except Exception as err:  # noqa: BLE001 - an internal error is a result of the suite
        where = traceback.extract_tb(err.__traceback__)[-1]
        return "crash", f"{type(err).__name__}: {err} ({Path(where.filename).name}:{where.lineno})", ""
    finally:
        signal.alarm(0)


@contextlib.contextmanager
def _isolated(folders: list[str]) -> Iterator[None]:
    """sys.path and the case modules as they were before: the next mutant imports its own."""
    path_before, modules_before = list(sys.path), set(sys.modules)
    try:
        yield
    finally:
        forget_case_modules(modules_before, folders)
        sys.path[:] = path_before


class _OutOfTime(Exception):
    pass


def _out_of_time(*_: object) -> None:
    raise _OutOfTime("verification took longer than the time limit")


def judge(mutant: Mutant, truth: Truth, verdict: str, detail: str, site: str, lines: set[int]) -> Outcome:
    """The mutant's row; a killed mutant is localised when the first site is one of `lines`
    (fault_lines: where the programmer has to change the code), near when within NEAR of one."""
    if verdict == "crash":
        row = "crash"
    elif truth.status == "raises":
        row = "raises/unusable" if verdict == "unusable" else "raises/verdict"
    elif truth.status == "differs":
        row = {"discrepancy": "killed", "equivalent": "unsound", "unknown": "unknown"}.get(verdict, "unusable-but-runs")
    else:
        row = {"discrepancy": "false", "equivalent": "equivalent-mutant"}.get(verdict, "unproven")
    outcome = Outcome(mutant.describe(), mutant.operator, truth.status, truth.detail, verdict, detail, row, site)
    if row == "killed" and site:
        file, _, line = site.rpartition(":")
        if Path(file).name == mutant.path.name:
            distance = min(abs(int(line) - wanted) for wanted in lines)
            outcome.on_line, outcome.near = distance == 0, distance <= NEAR
    return outcome


def table(outcomes: list[Outcome]) -> str:
    counts = collections.Counter(o.row for o in outcomes)
    lines = ["| outcome | mutants |", "| --- | --- |", *(f"| {row} | {counts[row]} |" for row in ROWS)]
    lines.append(f"| total | {len(outcomes)} |")
    differs = [o for o in outcomes if o.truth == "differs" and o.row != "crash"]
    killed = [o for o in differs if o.row == "killed"]
    unknown = [o for o in differs if o.row in ("unknown", "unusable-but-runs")]
    lines += ["", "| figure | value | target |", "| --- | --- | --- |",
              f"| really differ | {len(differs)} | |",
              f"| found (discrepancy) | {_share(len(killed), len(differs))} | >= 95% |",
              f"| unknown or unusable | {_share(len(unknown), len(differs))} | <= 5% |",
              f"| mutated line first | {_share(sum(o.on_line for o in killed), len(killed))} | >= 80% |",
              f"| within {NEAR} lines | {_share(sum(o.near for o in killed), len(killed))} | >= 95% |",
              f"| unsound / false / crash | {counts['unsound']} / {counts['false']} / {counts['crash']} | 0 / 0 / 0 |"]
    operators = sorted({o.operator for o in outcomes})
    lines += ["", "| operator | mutants | differ | killed | unknown | on line | raises | same |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for operator in operators:
        mine = [o for o in outcomes if o.operator == operator]
        lines.append(f"| {operator} | {len(mine)} | {sum(o.truth == 'differs' for o in mine)} | "
                     f"{sum(o.row == 'killed' for o in mine)} | "
                     f"{sum(o.row in ('unknown', 'unusable-but-runs') for o in mine)} | "
                     f"{sum(o.on_line for o in mine)} | {sum(o.truth == 'raises' for o in mine)} | "
                     f"{sum(o.truth == 'same' for o in mine)} |")
    return "\n".join(lines)


def _share(part: int, whole: int) -> str:
    return f"{part}/{whole} = {100 * part / whole:.0f}%" if whole else "-"


def details(outcomes: list[Outcome]) -> str:
    """Every mutant not simply killed on its line, for triage."""
    shown = [o for o in outcomes if o.row not in ("killed", "equivalent-mutant", "raises/unusable") or not o.on_line
             and o.row == "killed"]
    return "\n".join(f"- {o.row}{' (site ' + o.site + ')' if o.row == 'killed' else ''}: {o.mutant}\n"
                     f"    truth: {o.truth_detail[:160]}\n    shardproof: {' '.join(o.detail.split())[:300]}"
                     for o in shown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", type=Path, help="case files (default: examples/ and tests/cases/*_fixed.py)")
    parser.add_argument("--n", type=int, default=300, help="mutants to draw (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="which mutants are drawn")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="seconds shardproof may take per mutant")
    parser.add_argument("--details", action="store_true", help="list every mutant not killed on its line")
    parser.add_argument("--jsonl", type=Path, help="write one JSON line per mutant here")
    parser.add_argument("--match", action="append", default=[],
                        help="of the mutants drawn, run only those whose description contains this (repeatable)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    chosen = choose([p.resolve() for p in args.cases] or default_cases(), args.n, args.seed)
    if args.match:
        chosen = [m for m in chosen if any(text in m.describe() for text in args.match)]
    outcomes = run(chosen, args.world_size, args.timeout)
    if args.jsonl:
        args.jsonl.write_text("".join(json.dumps(asdict(o)) + "\n" for o in outcomes))
    print(f"mutants: {len(outcomes)} (seed {args.seed}, world size {args.world_size})\n")
    print(table(outcomes))
    if args.details:
        print("\n" + details(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
