"""Terms carried from one universe to another (partition/boundary.py): a piece's axis names the
product it is a part of by term id, so a copy must carry that term along and name its copy; else
it names whatever term has that id in the other universe (an IndexError, or a wrong term)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardproof import verify
from shardproof.case import load_case
from shardproof.oracle import run_numeric
from shardproof.partition.boundary import build_entries, read_boundary, transplant
from shardproof.relations.rules import Rules

ZIGZAG = Path(__file__).parents[1] / "cases" / "cp-zigzag-mask_fixed.py"


def _piece_of_product(r: Rules) -> tuple[int, int]:
    """(a, piece of a @ b over the first half of the contracted dim): its axis names a @ b."""
    a, b = r.leaf("a", (2, 4), "float32"), r.leaf("b", (4, 3), "float32")
    core = r.build("matmul", (a, b), (), (2, 3), "float32")
    return a, r.piece(core, ("matmul", core), 0, 2, 4)


def _names_a_product(r: Rules, t: int) -> bool:
    named = r.u[t].attrs[0][1]
    return r.u[named].op == "matmul" and r.u[named].shape == (2, 3)


def test_a_transplanted_piece_names_the_copy_of_its_product() -> None:
    source = Rules()
    a, piece = _piece_of_product(source)
    target = Rules()
    for _ in range(3):  # ids in the target other than the source's
        target.leaf("other", (1,), "float32")
    copied, = transplant(source.u, target, [piece], {a: target.leaf("x", (2, 4), "float32")})
    assert target.u[copied].op == "piece" and _names_a_product(target, copied)


def test_a_piece_read_into_a_boundary_and_built_again_names_its_product() -> None:
    source = Rules()
    _, piece = _piece_of_product(source)
    boundary = read_boundary(source.u, [], [[piece]], lambda t: False)
    target, terms = Rules(), []
    build_entries(target, boundary.entries, terms)
    assert _names_a_product(target, terms[boundary.rank_args[0][0]])


def test_zigzag_chunks_taken_out_of_order_are_a_discrepancy_not_a_crash() -> None:
    """The loader's second chunk index made negative (`1 - 2 * world_size - rank`): rank 0 holds
    chunks 0 and 1, rank 1 chunks 1 and 0; attention per layer call carries pieces of the masked
    product across the call boundary."""
    case = load_case(ZIGZAG)
    case.shard_input = lambda index, full, rank, n: torch.cat(
        [(chunks := full.chunk(2 * n, dim=0))[rank], chunks[1 - 2 * n - rank]], dim=0)
    report = verify(case, world_size=2)
    assert report.verdict == "discrepancy", report.diagnosis
    assert not run_numeric(case, 2).agree
    fixed = load_case(ZIGZAG)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree
