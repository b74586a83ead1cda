"""Bugs injected into transformers' own TP plan and loader, each a discrepancy of its kind at the
line that carries it, and each fixed twin proven equivalent; the numeric oracle agrees with every
verdict. (A plan entry that makes the real program fail, `colwise` made `rowwise` say, is no
silent bug: the run raises, and shardproof says the input is unusable.)"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("transformers", minversion="5", reason="needs the hf extra: pip install 'shardproof[hf]'")

from transformers.distributed.sharding_utils import DtensorShardOperation  # noqa: E402

from shardproof import verify  # noqa: E402
from shardproof.integrations.transformers import tiny_config, transformers_case  # noqa: E402
from shardproof.oracle import run_numeric  # noqa: E402

WORLD = 2


def _contiguous_slice(every_rank_shard_0: bool) -> Callable:
    """transformers' `_compute_contiguous_slice` (distributed/sharding_utils.py) for one interval
    that the world size divides, its chunk patched to 0 on every rank when `every_rank_shard_0`."""

    def _compute_contiguous_slice(self, intervals: list[tuple[int, int]], rank: int, world_size: int) -> list[tuple[int, int]]:
        ((start, end),) = intervals
        length = (end - start) // world_size
        chunk = 0 if every_rank_shard_0 else rank
        return [(start + chunk * length, start + (chunk + 1) * length)]

    return _compute_contiguous_slice


# (name, mode, plan entries changed, patched loader, kind, the culprit's file and code)
BUGS = [
    ("lm-head-without-its-gather", "forward", {"lm_head": "colwise"}, None,
     "wrong layout", ("modeling_llama.py", "logits = self.lm_head(hidden_states)")),
    ("loader-every-rank-shard-0", "forward", None, _contiguous_slice(every_rank_shard_0=True),
     "overlapping shards", ("sharding_utils.py", "source[tuple(slice_parts)]")),
    ("loader-every-rank-shard-0-trained", "train", None, _contiguous_slice(every_rank_shard_0=True),
     "overlapping shards", ("sharding_utils.py", "source[tuple(slice_parts)]")),
]


def _run(mode: str, plan: dict[str, str] | None, loader: Callable | None, monkeypatch: pytest.MonkeyPatch):
    if loader is not None:
        monkeypatch.setattr(DtensorShardOperation, "_compute_contiguous_slice", loader)
    case = transformers_case(tiny_config("llama"), tp_plan=plan, world_size=WORLD, train=mode == "train")
    return verify(case, world_size=WORLD, train=mode == "train", backend="none"), run_numeric(case, WORLD, mode=mode)


@pytest.mark.parametrize("name, mode, plan, loader, kind, culprit", BUGS, ids=[b[0] for b in BUGS])
def test_an_injected_bug_is_found_at_its_line(name, mode, plan, loader, kind, culprit, monkeypatch: pytest.MonkeyPatch) -> None:
    report, numbers = _run(mode, plan, loader, monkeypatch)
    assert report.exit_code == 1 and report.kind == kind, report.diagnosis or report.unknown
    first = report.distributed[0]
    assert (Path(first.file).name, culprit[1] in first.code) == (culprit[0], True), first
    assert not numbers.agree


@pytest.mark.parametrize("name, mode, loader", [(b[0], b[1], b[3]) for b in BUGS], ids=[b[0] for b in BUGS])
def test_the_fixed_twin_is_proven(name, mode, loader, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's own plan, and the loader's slice computed for each rank (the patch without its bug)."""
    report, numbers = _run(mode, None, None if loader is None else _contiguous_slice(every_rank_shard_0=False), monkeypatch)
    assert report.exit_code == 0, report.diagnosis or report.unknown
    assert numbers.agree
