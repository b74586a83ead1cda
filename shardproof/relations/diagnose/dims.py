"""An op working along another dim than its values need (a softmax over the queries instead of the
keys, a max over the batch instead of the vocabulary): its operand agrees with the reference and its
value does not, but the same op along another dim of the same operand agrees. The values part at
that op, so it is the site, not the view or product that later cannot use its value. A part of
`Diagnoser`.

A value over the wrong dim may agree by itself (a block's log-sum-exp over its queries is as much a
partial result as over its keys) and part ways only where it is combined (the merge of the blocks):
the op that made it is still the site when, along another dim, the ops after it agree again.
"""

from __future__ import annotations

from typing import Iterator

import torch

from shardproof.ir.graph import Node
from shardproof.ir.ops import run_op
from shardproof.relations.diagnose.finding import Finding
from shardproof.report.terms import describe, line_of, value_name

# ops (and normal-form terms) over one dim, with how their attrs hold it: a bare dim, or a one-dim tuple
SEARCHED = 64  # agreeing values before a failing op searched for one over the wrong dim, at most
MERGED = 48  # ops replayed after such a value, at most (a merge of blocks' log-sum-exps takes ~20)
ONE_DIM = {"softmax": int, "log_softmax": int, "logsumexp": int, "sum": tuple, "amax": tuple, "argmax": tuple}


class OtherDims:
    def _along_other_dim(self, rank: int, chain: list[Node]) -> Finding | None:
        """At the first op of the disagreeing chain where one shows: an op over one dim of an
        agreeing operand that, along another dim of that operand, agrees (a normal form the rules
        reach, never a guess) or makes an op after it agree (a block's softmax once merged); else an
        agreeing value before it, over one dim, whose twin along another dim makes the ops after it
        agree (a block's log-sum-exp over its queries, which agrees by itself)."""
        terms = self.run.ranks[rank]
        for node in chain:  # where the values part: the op disagrees, its operands do not
            if not self._agrees(terms[node.id]) and all(self._agrees(terms[i]) for i in node.inputs):
                found = self._other_dim_op(rank, node) or self._other_dim_before(rank, node)
                if found is not None:
                    return found
        return None

    def _other_dim_op(self, rank: int, node: Node) -> Finding | None:
        terms = self.run.ranks[rank]
        if len(node.inputs) != 1:
            return None
        for dim, other, twin, shape in self._twins(node.op, node.attrs, terms[node.inputs[0]], node.dtype):
            if self._agrees(twin) or shape == tuple(node.shape) and self._agrees_after(rank, node, twin):
                return self._other_dim_finding(rank, node, node.op, dim, other, "it agrees with the reference", node)
        return None

    def _other_dim_before(self, rank: int, node: Node) -> Finding | None:
        """The earliest of the agreeing values before the failing `node` (up to SEARCHED of them)
        that is a term over one dim whose twin along another dim makes the ops after it agree."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        stack, seen = [graph[i] for i in node.inputs], set()
        while stack and len(seen) < SEARCHED:
            made = stack.pop()
            if made.id not in seen and made.op not in ("leaf", "const") and self._agrees(terms[made.id]):
                seen.add(made.id)
                stack.extend(graph[i] for i in made.inputs)
        for made in (graph[i] for i in sorted(seen)):
            t = terms[made.id]
            term = self.r.u[t]
            if len(term.args) != 1:
                continue
            for dim, other, twin, shape in self._twins(term.op, term.attrs, term.args[0], made.dtype):
                if shape == self.r.shape(t) and self._heals(rank, made, twin, limit=MERGED):
                    return self._other_dim_finding(rank, made, term.op, dim, other,
                                                   "the ops after it agree with the reference", node)
        return None

    def _twins(self, op: str, attrs: tuple, operand: int, dtype: str) -> Iterator[tuple[int, int, int, tuple[int, ...]]]:
        """(dim, other dim, the op along the other dim, its shape) for `op` over one dim of `operand`."""
        source = self.r.shape(operand)
        dim = _dim_of(op, attrs, len(source))
        if dim is None:
            return
        for other in range(len(source)):
            if other != dim and source[other] > 1:
                along = _along(op, attrs, other)
                try:
                    shape = tuple(run_op(op, [torch.empty(source, device="meta")], along).shape)
                except (IndexError, TypeError, ValueError, RuntimeError):  # a term's attrs no op of that name takes
                    return
                yield dim, other, self.r.build(op, (operand,), along, shape, dtype), shape

    def _other_dim_finding(self, rank: int, site: Node, op: str, dim: int, other: int, agrees: str, failing: Node) -> Finding:
        operand = self.r.u[self.run.ranks[rank][site.id]].args[0] if site is not failing else \
            self.run.ranks[rank][site.inputs[0]]
        sizes = self.r.shape(operand)
        where = "" if site is failing else f" (they part ways at `{failing.op}` at {line_of(failing)})"
        return Finding(
            "discrepancy",
            "wrong layout",
            f"wrong layout: on rank {rank}, `{op}` at {line_of(site)} works along dim {dim} (size {sizes[dim]}) of "
            f"`{describe(self.r.u, operand, 2)}`; along dim {other} (size {sizes[other]}) {agrees}{where}",
            [(rank, site)] if site is failing else [(rank, site), (rank, failing)],
            op=op,
            fix=f"take the `{op}` of {value_name(site)} at {line_of(site)} along dim {other}",
        )


def _dim_of(op: str, attrs: tuple, ndim: int) -> int | None:
    """The one dim `op` with `attrs` works along, of an operand of `ndim` dims (made non-negative),
    or None for another op."""
    kind = ONE_DIM.get(op)
    if kind is None or not attrs or ndim == 0:
        return None
    dim = attrs[0] if kind is int else (attrs[0][0] if isinstance(attrs[0], tuple) and len(attrs[0]) == 1 else None)
    return dim % ndim if isinstance(dim, int) else None


def _along(op: str, attrs: tuple, dim: int) -> tuple:
    """`attrs` with `dim` in place of the one `op` works along."""
    return (dim if ONE_DIM[op] is int else (dim,), *attrs[1:])
