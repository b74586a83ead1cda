"""Numeric check of imported graphs: run the reference and all ranks on random inputs, compare.

Like `oracle.py` for case files, it checks the verifier: a discrepancy stands only if the
numbers differ. Integer inputs get small non-negative values below every table size the
reference looks them up in, so lookups stay in range.
"""

from __future__ import annotations

import torch

from shardproof.ir.graph import Graph
from shardproof.ir.run import numeric_dtype, run_graph, run_ranks
from shardproof.programs import Check, NumericResult


def random_leaves(reference: Graph, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tables = [reference[n.inputs[0]].shape[0] for n in reference.nodes if n.op == "embedding"]
    bound = max(1, min(tables, default=8))
    leaves = {}
    for node in reference.nodes:
        if node.op != "leaf":
            continue
        dtype = numeric_dtype(node.dtype)
        if dtype.is_floating_point:
            leaves[node.attrs[0]] = torch.randn(node.shape, generator=gen, dtype=dtype)
        elif dtype == torch.bool:
            leaves[node.attrs[0]] = torch.rand(node.shape, generator=gen) < 0.5
        else:
            leaves[node.attrs[0]] = torch.randint(0, bound, node.shape, generator=gen, dtype=dtype)
    return leaves


def run_graphs(reference: Graph, ranks: list[Graph], checks: list[Check], rtol: float = 1e-6) -> NumericResult:
    """Every check's rank outputs against the reference output, relative to its largest value,
    claim by claim."""
    leaves = random_leaves(reference)
    expected = run_graph(reference, leaves)
    outs = run_ranks(ranks, leaves)
    worst: dict[str, tuple[float, float, str]] = {}  # per check: (relative error, absolute error, where)
    for check in checks:
        want, layout, index = expected[check.expected], check.relation, check.actual
        got = [o[index] for o in outs]
        candidates = [torch.cat(got, layout[1])] if layout[0] == "shard" else got
        scale = max(1.0, want.double().abs().max().item()) if want.numel() else 1.0
        for rank, value in enumerate(candidates):
            error = (value.double() - want.double()).abs().max().item() if want.numel() else 0.0
            where = check.label + ("" if layout[0] == "shard" else f" of rank {rank}")
            if error / scale > worst.get(check.label, (0.0,))[0]:
                worst[check.label] = (error / scale, error, where)
    relative, absolute, where = max(worst.values(), default=(0.0, 0.0, ""))
    differing = {label: f"{w} differs by {r:.3g} (relative)" for label, (r, _, w) in worst.items() if r > rtol}
    if differing:
        return NumericResult(False, absolute, relative, f"{where} differs by {relative:.3g} (relative)", differing)
    return NumericResult(True, absolute, relative, f"all outputs agree to {relative:.1g}")
