"""An op working along another dim than its values need (a softmax over the queries instead of the
keys, a max over the batch instead of the vocabulary): its operand agrees with the reference and its
value does not, but the same op along another dim of the same operand agrees. The values part at
that op, so it is the site, not the view or product that later cannot use its value. A part of
`Diagnoser`.
"""

from __future__ import annotations

import torch

from shardproof.ir.graph import Node
from shardproof.ir.ops import run_op
from shardproof.relations.diagnose.finding import Finding
from shardproof.report.terms import line_of, value_name

# ops over one dim, with where their attrs hold it: a bare dim, or a one-dim tuple
ONE_DIM = {"softmax": int, "log_softmax": int, "logsumexp": int, "sum": tuple, "amax": tuple, "argmax": tuple}


class OtherDims:
    def _along_other_dim(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first op of the disagreeing chain over one dim of an agreeing operand that, along
        another dim of that operand, agrees (a normal form the rules reach, never a guess), or
        makes an op after it agree (a block's softmax agrees once merged with the other blocks')."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        for node in chain:
            source = graph[node.inputs[0]] if node.inputs else node
            dim = _dim_of(node, len(source.shape))
            if dim is None or not self._agrees(terms[source.id]) or self._agrees(terms[node.id]):
                continue
            for other in range(len(source.shape)):
                if other == dim or source.shape[other] == 1:
                    continue
                attrs = _along(node, other)
                shape = tuple(run_op(node.op, [torch.empty(source.shape, device="meta")], attrs).shape)
                twin = self.r.build(node.op, (terms[source.id],), attrs, shape, node.dtype)
                if not (self._agrees(twin) or shape == tuple(node.shape) and self._agrees_after(rank, node, twin)):
                    continue
                return Finding(
                    "discrepancy",
                    "wrong layout",
                    f"wrong layout: on rank {rank}, `{node.op}` at {line_of(node)} works along dim {dim} of "
                    f"{value_name(source)} (size {source.shape[dim]}); along dim {other} (size {source.shape[other]}) "
                    "it agrees with the reference",
                    [(rank, node)],
                    op=node.op,
                    fix=f"take the `{node.op}` at {line_of(node)} along dim {other}",
                )
        return None


def _dim_of(node: Node, ndim: int) -> int | None:
    """The one dim `node` works along, of an operand of `ndim` dims (made non-negative), or None
    for another op."""
    kind = ONE_DIM.get(node.op)
    if kind is None or len(node.inputs) != 1 or not node.attrs or ndim == 0:
        return None
    dim = node.attrs[0] if kind is int else (node.attrs[0][0] if len(node.attrs[0]) == 1 else None)
    return dim % ndim if isinstance(dim, int) else None


def _along(node: Node, dim: int) -> tuple:
    """`node`'s attrs with `dim` in place of the one it works along."""
    return (dim if ONE_DIM[node.op] is int else (dim,), *node.attrs[1:])
