"""Candidate values for tensor constants a dump names but does not record.

A rank that fills part of its partial result with a constant before a reduction over ranks
(Megatron's vocab-parallel cross entropy: `predicted_logits[target_mask] = 0.0`, then an
all-reduce sum) computes the reference's value only if that constant is the reduction's identity,
since every rank but the owner contributes it. So the candidates for a constant are the identities
of the reductions over ranks its value reaches, nearest first; the proof decides whether one is
right (`importers/verify.py`), and the report lists the value taken. A constant that reaches no
reduction has no candidate and stays an unknown input.
"""

from __future__ import annotations

import math
from collections import deque

from shardproof.ir.graph import Graph

IDENTITY = {"sum": 0, "mean": 0, "max": -math.inf, "min": math.inf}


def reduction_identities(graph: Graph, leaf: int) -> list[tuple[float, str]]:
    """(identity, reduction op) of each reduction over ranks `leaf` flows into, nearest first;
    infinities are left out for integer constants, which cannot hold them."""
    users: dict[int, list[int]] = {}
    for node in graph.nodes:
        for i in node.inputs:
            users.setdefault(i, []).append(node.id)
    integral = not graph[leaf].dtype.startswith(("float", "bfloat"))
    found: list[tuple[float, str]] = []
    seen, queue = {leaf}, deque([leaf])
    while queue:
        node = graph[queue.popleft()]
        if node.op in ("all_reduce", "reduce_scatter"):
            op = node.attrs[0] if node.op == "all_reduce" else node.attrs[1]
            value = IDENTITY.get(op)
            if value is not None and not (integral and math.isinf(value)) and all(v != value for v, _ in found):
                found.append((value, op))
        for user in users.get(node.id, []):
            if user not in seen:
                seen.add(user)
                queue.append(user)
    return found
