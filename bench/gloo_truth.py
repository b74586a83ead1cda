"""Ground truth for a case file: every rank run for real, one gloo process each, in float64.

Independent of the prover: the ranks are separate processes talking through torch.distributed's
gloo backend, as a user's job would. What each side computes and which claims are compared
(outputs, loss, gradients) is the case contract's (`shardproof.steps`, via the oracle's
`run_reference` / `run_rank` / `judge`); only the process group differs from the oracle's threads.
The processes stay up between cases (importing torch is most of a process's start-up); each case
gets its own process groups, so a case that breaks its group leaves the next one a fresh one.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# A collective that a peer never joins fails after this long (gloo's own timeout).
COLLECTIVE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Truth:
    """What really happens: "same" or "differs" (numbers, or ranks that wait for each other for
    ever), or "raises" (a rank's own exception: the program is not one that runs)."""

    status: str
    detail: str
    rank: int | None = None  # "raises": the rank whose exception it is
    line: int | None = None  # "raises": its line in the case file


class GlooRanks:
    """`world_size` processes in a gloo world, running one case file at a time."""

    def __init__(self, world_size: int, search_path: list[str]):
        self.world_size, self.search_path = world_size, search_path
        self.context = mp.get_context("spawn")
        self._start()

    def __enter__(self) -> GlooRanks:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def run(self, path: Path, mode: str | None, seed: int = 0) -> Truth:
        """Run the case file on every rank; compare each rank's claims with the reference's."""
        store = tempfile.mkdtemp(prefix="gloo-")
        for jobs in self.jobs:
            jobs.put((str(path), mode, seed, store))
        answers, deadline = {}, time.monotonic() + 3 * COLLECTIVE_TIMEOUT_S + 120
        while len(answers) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not all(p.is_alive() for p in self.processes):
                self.close()
                self._start()
                waiting = sorted(set(range(self.world_size)) - set(answers))
                return Truth("differs", f"ranks {waiting} never finished (or died)")
            try:
                rank, answer = self.results.get(timeout=min(remaining, 1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: look at the processes again
                continue
            answers[rank] = answer
        return _verdict(answers)

    def close(self) -> None:
        for jobs in self.jobs:
            jobs.put(None)
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()

    def _start(self) -> None:
        self.results = self.context.Queue()
        self.jobs = [self.context.Queue() for _ in range(self.world_size)]
        self.processes = [self.context.Process(target=_serve, args=(rank, self.world_size, self.search_path, jobs,
                                                                    self.results), daemon=True)
                          for rank, jobs in enumerate(self.jobs)]
        for process in self.processes:
            process.start()


def _verdict(answers: dict[int, tuple]) -> Truth:
    import torch

    from shardproof.oracle import compare
    from shardproof.steps import merged

    own = {rank: a for rank, a in answers.items() if a[0] == "raised" and not a[3]}
    if own:
        rank = min(own)
        return Truth("raises", own[rank][1], rank, own[rank][2])
    if any(a[0] == "raised" for a in answers.values()):
        return Truth("differs", "ranks fail in collectives: " + "; ".join(sorted({a[1][:120] for a in answers.values()
                                                                                   if a[0] == "raised"})))
    runs = [torch.load(io.BytesIO(answers[rank][1]), weights_only=False) for rank in range(len(answers))]
    mismatched = [checks for _, _, checks in runs if isinstance(checks, str)]
    if mismatched:
        return Truth("differs", mismatched[0])
    checks = merged([checks for _, _, checks in runs])
    result = compare(runs[0][0], [outputs for _, outputs, _ in runs], checks)
    return Truth("same" if result.agree else "differs", result.detail)


def _serve(rank: int, world_size: int, search_path: list[str], jobs: Any, results: Any) -> None:
    import warnings

    import torch

    warnings.simplefilter("ignore")  # a case's deprecation warnings, once per rank and mutant
    torch.set_num_threads(1)
    sys.path[:0] = search_path
    while (job := jobs.get()) is not None:
        results.put((rank, _run(rank, world_size, search_path, *job)))


def _run(rank: int, world_size: int, search_path: list[str], path: str, mode: str | None, seed: int, store: str) -> tuple:
    """("ok", serialized (reference outputs, (outputs, trained))) or ("raised", message, line, in_collective)."""
    import torch
    import torch.distributed as dist

    from shardproof.case import load_case
    from shardproof.errors import CaseError
    from shardproof.oracle import numeric_setting, run_rank, run_reference

    path_before, modules_before = list(sys.path), set(sys.modules)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    try:
        case = load_case(path)
        with numeric_setting(seed):
            dist.init_process_group("gloo", init_method=f"file://{store}/reference-{rank}", rank=0, world_size=1,
                                    timeout=timeout)
            try:
                reference = run_reference(case, mode or case.mode)
            finally:
                dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"file://{store}/world", rank=rank, world_size=world_size,
                                    timeout=timeout)
            try:
                outputs, trained = run_rank(case, reference, rank, world_size)
            finally:
                dist.destroy_process_group()
        try:
            checks: list | str = reference.program.checks(len(reference.outputs), len(outputs), trained)
        except CaseError as mismatch:  # outputs that cannot be compared: a difference, not a failure
            checks = str(mismatch)
        buffer = io.BytesIO()
        torch.save((reference.outputs if rank == 0 else None, outputs, checks), buffer)
        return ("ok", buffer.getvalue())
    except BaseException as err:  # noqa: BLE001 - the program's own failure is part of the truth
        return ("raised", f"{type(err).__name__}: {err}"[:300], _line_in(err, path), _in_collective(err))
    finally:
        forget_case_modules(modules_before, [str(Path(path).parent), *search_path])
        sys.path[:] = path_before
        if os.environ.get("SHARDPROOF_MUTATE_DEBUG"):
            traceback.print_exc()


def forget_case_modules(before: set[str], folders: list[str]) -> None:
    """Unload the modules a case file brought in from its own folders (its siblings may be mutated
    next); the libraries it imported stay (some cannot be imported twice in one process)."""
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if name.startswith("shardproof_case_") or any(file.startswith(f + os.sep) for f in folders if f):
            del sys.modules[name]


def _line_in(err: BaseException, path: str) -> int | None:
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == path]
    return lines[-1] if lines else None


def _in_collective(err: BaseException) -> bool:
    """A failure a peer caused (it left, or never joined): gloo's errors, not the rank's own."""
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, dist.DistBackendError) or any(
        marker in text for marker in ("Connection closed by peer", "Timed out", "Wait timeout", "gloo", "Gloo", "Broken pipe"))
