"""Ranks traced in worker processes (a local pool, a Ray cluster) give the graphs, and so the
report, that tracing them here gives."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardproof.capture.torch_capture import capture_ranks
from shardproof.case import Case, load_case
from shardproof.cli import main
from shardproof.ir.graph import Graph
from shardproof.partition import backends
from shardproof.partition.backends import _on_pool, load_spec, portable

ROOT = Path(__file__).parents[2]
LLAMA = ROOT / "examples" / "llama_tp.py"
BUGGY = ROOT / "tests" / "cases" / "missing-allreduce_buggy.py"
ATTENTION = ROOT / "examples" / "attention_tp.py"


def _llama(layers: int) -> Case:
    case = load_case(LLAMA)
    case.module.CONFIG = dataclasses.replace(case.module.CONFIG, n_layers=layers)
    return case


def _shape(graph: Graph) -> list[tuple]:
    """What a graph computes, without object identities (templates are per process)."""
    return [(n.op, n.inputs, n.shape, n.dtype, n.loc) for n in graph.nodes]


def test_a_worker_loads_the_case_with_the_drivers_settings() -> None:
    case = _llama(3)
    spec = portable(case)
    assert spec is not None
    assert load_spec(spec).module.CONFIG.n_layers == 3


def test_a_case_built_in_python_stays_in_this_process() -> None:
    case = Case(lambda: torch.nn.Linear(2, 2), lambda rank, n: torch.nn.Linear(2, 2), lambda: (torch.randn(2),))
    assert portable(case) is None


@pytest.mark.slow
def test_a_process_pool_traces_the_ranks_this_process_would() -> None:
    case = _llama(3)
    here = capture_ranks(case, 4, [1, 2, 3])
    pooled = list(_on_pool(portable(case), 4, [1, 2, 3], True, workers=2))
    assert [g.rank for g in pooled] == [1, 2, 3]
    assert [_shape(g) for g in pooled] == [_shape(g) for g in here]


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster of its own (a head node), stopped with its process group afterwards."""
    pytest.importorskip("ray")
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent))
    if ray_cli is None:
        pytest.skip("the ray command is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    try:
        _wait_for(address)
        yield address
    finally:
        import ray

        ray.shutdown()
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a loaded machine can keep Ray's head busy stopping
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _wait_for(address: str, timeout: float = 120.0) -> None:
    host, port = address.split(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"no Ray head at {address}")


def _report(tmp_path: Path, case: Path, world_size: int, *options: str) -> dict:
    out = tmp_path / f"{case.stem}{len(options)}.json"
    main(["verify", str(case), "--world-size", str(world_size), "--quiet", "--json", str(out), *options])
    report = json.loads(out.read_text())
    del report["seconds"]
    return report


@pytest.mark.parametrize(
    "case, world_size, on_ray",
    [
        (LLAMA, 2, []),  # one trace holds for both ranks (capture/symbolic_rank): nothing to send
        (BUGGY, 2, []),
        (ATTENTION, 4, [3]),  # its ranks pick their heads by `range(rank * n, ...)`: traced one by one
    ],
    ids=lambda value: value.stem if isinstance(value, Path) else None,
)
def test_ray_gives_the_report_of_the_default_backend(
    ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Path, world_size: int, on_ray: list[int]
) -> None:
    default = _report(tmp_path, case, world_size)
    sent: list[int] = []
    send = backends._on_ray
    monkeypatch.setattr(backends, "_on_ray", lambda spec, n, ranks, *rest: (sent.extend(ranks), send(spec, n, ranks, *rest))[1])
    assert _report(tmp_path, case, world_size, "--backend", "ray", "--ray-address", ray_address) == default
    assert sent == on_ray
    assert default["verdict"] == ("discrepancy" if case == BUGGY else "equivalent")
