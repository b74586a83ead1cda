"""torchtitan 0.3.0's own tensor and sequence parallelism (its sharding configs, `Module.parallelize`,
its spmd_types collectives, its loader's cuts, its vocab-parallel embedding and loss) on tiny
llama3 and qwen3 configs built by its own config builders, with its defaults: FlexAttention
forward; training with its SDPA attention, as FlexAttention's backward refuses the CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="needs the titan extra: pip install 'shardproof[titan]'")

from shardproof import verify  # noqa: E402
from shardproof.integrations.torchtitan import tiny_config, torchtitan_case  # noqa: E402
from shardproof.oracle import run_numeric  # noqa: E402

RUNS = [(mode, n) for mode, sizes in (("forward", (2, 4, 8)), ("train", (2, 4))) for n in sizes]
SLOW = {("forward", 8), ("train", 2), ("train", 4)}


def _params(models: list[str]) -> list:
    return [
        pytest.param(model, sp, mode, n, marks=[pytest.mark.slow] if (mode, n) in SLOW else [],
                     id=f"{model}-{'sp' if sp else 'tp'}-{mode}-{n}")
        for model in models for sp in (False, True) for mode, n in RUNS
    ]


@pytest.mark.parametrize("model, sequence_parallel, mode, world_size", _params(["llama3", "qwen3"]))
def test_torchtitan_parallelize_computes_the_reference(model: str, sequence_parallel: bool, mode: str, world_size: int) -> None:
    attention = "flex" if mode == "forward" else "sdpa"
    case = torchtitan_case(tiny_config(model, sequence_parallel=sequence_parallel, attention=attention), world_size, mode=mode)
    numbers = run_numeric(case, world_size, mode=mode)
    assert numbers.agree, numbers.detail
    report = verify(case, world_size=world_size)
    assert report.verdict == "equivalent", report.diagnosis
