"""Where the ranks are traced: in this process, in a local process pool (default), or on Ray.

Ranks are traced independently of one another (each over the reference's leaves), so they are the
unit of parallel work; a worker re-loads the case from its file, sets the case module's plain-data
globals to the driver's (a preset, a bench's `n_layers`), traces its share with `capture_ranks`
and returns the IR graphs. Graphs do not depend on where they were traced, so neither does the
report. A case built in Python (no file) is traced in this process.
"""

from __future__ import annotations

import math
import os
import pickle
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from types import ModuleType
from typing import Any, Callable, Iterator

from shardproof.capture.torch_capture import capture_ranks
from shardproof.case import Case, load_case
from shardproof.errors import CaseError
from shardproof.gc_tuning import fewer_collections
from shardproof.ir.graph import Graph
from shardproof.partition.fingerprint import value_key

BACKENDS = ("local", "ray", "none")
WORTH_A_POOL = 10.0  # seconds of rank tracing here above which workers pay off (each imports torch first)


@dataclass(frozen=True)
class CaseSpec:
    """A case as a worker can load it: its file, and the case module's plain-data globals."""

    path: str
    settings: bytes  # pickled {name: value}, unpickled after the file is imported


def portable(case: Case) -> CaseSpec | None:
    """The case's spec, or None if it cannot be re-loaded elsewhere (no file, unpicklable data)."""
    if case.source is None or case.module is None:
        return None
    settings = {name: value for name, value in vars(case.module).items() if _is_data(name, value)}
    try:
        return CaseSpec(str(case.source), pickle.dumps(settings))
    except Exception:  # noqa: BLE001 - any unpicklable global keeps the case in this process
        return None


def _is_data(name: str, value: Any) -> bool:
    if name.startswith("__") or isinstance(value, (ModuleType, type)) or callable(value):
        return False
    return "id" not in _flat_kinds(value_key(value))


def _flat_kinds(key: Any) -> set:
    """The tags of a value key and of every key nested in it ("id" marks a non-data object)."""
    if not isinstance(key, tuple):
        return set()
    kinds = {key[0]} if key and isinstance(key[0], str) else set()
    for part in key:
        kinds |= _flat_kinds(part)
    return kinds


def load_spec(spec: CaseSpec) -> Case:
    case = load_case(spec.path)
    for name, value in pickle.loads(spec.settings).items():
        setattr(case.module, name, value)
    return case


def trace_share(spec: CaseSpec, world_size: int, ranks: list[int], memo: bool) -> list[Graph]:
    """A worker's task: its ranks' graphs."""
    case = load_spec(spec)
    with fewer_collections(), case.importable():
        return capture_ranks(case, world_size, ranks, memo)


RankTracer = Callable[[list[int]], Iterator[Graph]]


def placement(
    backend: str, case: Case, world_size: int, memo: bool, ray_address: str | None = None
) -> Callable[[float], RankTracer | None]:
    """Given the seconds rank 0 took to trace, where the other ranks are traced: a function that
    traces them elsewhere, or None for this process (small cases: workers would cost more)."""
    if backend not in BACKENDS:
        raise CaseError(f"unknown backend `{backend}` (one of {', '.join(BACKENDS)})")
    spec = portable(case)

    def choose(rank_seconds: float) -> RankTracer | None:
        if backend == "none" or spec is None or world_size < 2:
            return None
        if backend == "ray":
            return lambda ranks: _on_ray(spec, world_size, ranks, memo, ray_address)
        workers = min(idle_cores(), world_size - 1)
        if workers < 2 or rank_seconds * (world_size - 1) < WORTH_A_POOL:
            return None
        return lambda ranks: _on_pool(spec, world_size, ranks, memo, workers)

    return choose


def idle_cores() -> int:
    """Cores not busy over the last minute: workers beyond these only slow each other down."""
    return int((os.cpu_count() or 1) - os.getloadavg()[0])


def _shares(ranks: list[int], parts: int) -> list[list[int]]:
    """Contiguous shares of about equal size, in rank order."""
    size = math.ceil(len(ranks) / parts)
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def _on_pool(spec: CaseSpec, world_size: int, ranks: list[int], memo: bool, workers: int) -> Iterator[Graph]:
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(trace_share, spec, world_size, share, memo) for share in _shares(ranks, workers)]
        for future in futures:
            yield from future.result()


def _on_ray(spec: CaseSpec, world_size: int, ranks: list[int], memo: bool, address: str | None) -> Iterator[Graph]:
    try:
        import ray
    except ImportError as err:
        raise CaseError("--backend ray needs Ray: pip install 'shardproof[ray]'") from err
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    task = ray.remote(trace_share)
    parts = max(1, min(len(ranks), int(ray.cluster_resources().get("CPU", 1))))
    refs = [task.remote(spec, world_size, share, memo) for share in _shares(ranks, parts)]
    for ref in refs:
        yield from ray.get(ref)
