"""The `Rules` class: terms in normal form inside one Universe, built by its constructors (from
`regions.py`, `views.py` and `linear.py`) and, for IR ops, by the rule of the op's kind.
"""

from __future__ import annotations

from typing import Any, Callable

from shardproof.ir.ops import OPS
from shardproof.relations.layout import Box, box_along
from shardproof.relations.rules import elementwise, lookups, masks, one_hot, online_softmax, open_linear, products, reductions, topk
from shardproof.relations.rules.linear import LinearRules
from shardproof.relations.rules.regions import RegionRules
from shardproof.relations.rules.values import FLOAT_DTYPES, intended, real
from shardproof.relations.rules.views import ViewRules
from shardproof.relations.universe import Universe


class Rules(RegionRules, ViewRules, LinearRules):
    """Builds terms in normal form inside one Universe."""

    def __init__(self, universe: Universe | None = None) -> None:
        self.u = universe or Universe()
        self.reference_size: int | None = None  # terms below this id were built by the reference
        self.reference_boxes: dict[int, set[Box]] = {}  # root -> boxes the reference sliced it to
        self.reference_one_hots: dict[tuple[int, int], set[int]] = {}  # (dim, index) -> widths the reference wrote
        self._built: dict[tuple, int] = {}  # (op, args, attrs, shape, dtype) -> term
        self.attentions: dict[int, tuple[int, int]] = {}  # merged attention term -> (scores, values) (`online_softmax`)
        self.constant_terms: dict[int, bool] = {}  # term -> computed from constants alone (`of_constants`)
        self.unsliced: dict[tuple, int | None] = {}  # (term, box, shape, reference size) -> `unslice`'s answer, once the reference is built
        self.assumptions: set[str] = set()  # what a proof using these terms takes for granted (in words)
        self.vanishing: dict[tuple, Any] = {}  # (term, depth, reference size) -> `slots.vanishing`'s answer

    def in_reference(self, t: int) -> bool:
        """Where two normal forms are both true, rules prefer the one the reference built."""
        return self.reference_size is not None and t < self.reference_size

    # --- entry point for IR ops -------------------------------------------------------------------
    def build(self, op: str, args: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], dtype: str) -> int:
        """The normal-form term of IR op `op` applied to terms `args`, normalized once: an op the
        ranks repeat (each rank's view of one all-gathered tensor) and an op a rank applies to the
        very terms the reference applied it to (congruence: the reference's form is the normal form,
        whatever else the rules could prove of it once the reference is there to prefer)."""
        key = (op, args, attrs, shape, dtype)
        if key in self._built:
            return self._built[key]
        special = _BY_OP.get(op)
        term = special(self, args, attrs, shape, dtype) if special is not None else _BY_KIND[OPS[op].kind](self, op, args, attrs, shape, dtype)
        self._built[key] = term
        return term

    def shape(self, t: int) -> tuple[int, ...]:
        return self.u[t].shape

    def op(self, t: int) -> str:
        return self.u[t].op

    def literal(self, op: str, args: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], dtype: str) -> int:
        """Terms are values over the reals: every float dtype is one (a bf16 matmul of fp32 values
        cast down is the fp32 matmul); integer and bool dtypes stay apart."""
        return self.u.intern(op, args, attrs, shape, real(dtype))

    # --- leaves and constants ---------------------------------------------------------------------
    def leaf(self, name: str, shape: tuple[int, ...], dtype: str) -> int:
        return self.literal("leaf", (), (name,), shape, dtype)

    def const(self, spec: tuple, shape: tuple[int, ...], dtype: str) -> int:
        """A constant: one fill value (`full`, floats normalized) or explicit values / arange."""
        if spec[0] == "values" and len(set(spec[1])) == 1:
            spec = ("full", spec[1][0])
        if spec[0] != "full":
            return self.literal("const", (), spec, shape, dtype)
        value = intended(float(spec[1])) if dtype in FLOAT_DTYPES and not isinstance(spec[1], bool) else spec[1]
        return self.literal("full", (), (value,), shape, dtype)

    def full_value(self, t: int) -> Any | None:
        """The fill value if `t` is a constant filled with one value (possibly broadcast)."""
        term = self.u[t]
        if term.op == "full":
            return term.attrs[0]
        if term.op == "bcast":
            return self.full_value(term.args[0])
        return None


def _layout(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    x = args[0]
    if op == "view":
        return r.view(x, tuple(attrs[0]))
    if op == "permute":
        return r.permute(x, tuple(attrs[0]))
    if op == "slice":
        dim, lo, hi = attrs
        return r.slice(x, box_along(r.shape(x), dim, lo, hi))
    if op == "cat":
        return r.cat(list(args), attrs[0])
    if op == "expand":
        return r.expand(x, tuple(attrs[0]))
    if op == "convert":
        if dtype in FLOAT_DTYPES and r.u[x].dtype in FLOAT_DTYPES:
            return x  # equivalence is over the reals: float casts are the identity
        return elementwise.elementwise(r, op, args, attrs, shape, dtype)
    raise AssertionError(op)


_BY_OP: dict[str, Callable[..., int]] = {
    "add": elementwise.add,
    "mul": products.mul,
    "div": products.div,
    "log": reductions.log,
    "exp": reductions.exp,
    "log_softmax": reductions.log_softmax,
    topk.TOPK: topk.topk,
    "aten.remainder.Scalar": lambda r, args, attrs, shape, dtype: elementwise.remainder(r, "aten.remainder.Scalar", args, attrs, shape, dtype),
    **{op: lambda r, args, attrs, shape, dtype, op=op: masks.logical(r, op, args, attrs, shape, dtype) for op in ("logical_and", "logical_or", "logical_not")},
}
_BY_KIND: dict[str, Callable[..., int]] = {
    "unary": elementwise.unary,
    "binary": elementwise.elementwise,
    "compare": masks.compare,
    "where": lookups.where,
    "layout": _layout,
    "reduce": reductions.reduce,
    "softmax": reductions.softmax,
    "logsumexp": online_softmax.logsumexp,
    "matmul": products.matmul,
    "embedding": lookups.embedding,
    "gather": lookups.gather,
    "scatter": one_hot.scatter,
    "mask": masks.keep_literal,
    # open ops (ir/aten_ops.py), by the tags torch gives them
    "pointwise": elementwise.elementwise,
    "reduction": reductions.open_reduction,
    "leading": reductions.leading,
    "opaque": open_linear.opaque,  # congruence, and linearity by DTensor's strategies
}
