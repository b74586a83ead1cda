"""Data-dependent sizes in FX dumps (`i64[u0, 1]` from `nonzero`): rows picked by a mask, computed
row by row, then added back or summed (a MoE's token dispatch), are the same computation on every
row with the other rows masked out.

torch.compile names a size that depends on tensor values with an unbacked symbol (`u0`). The
proof works on fixed shapes, so such a region is rewritten into its dense form: a tensor T of the
u0 rows that `nonzero(mask)` picks (mask of N elements) is D[mask] for a tensor D of N rows, and
- `select(nonzero(mask), 1, 0)` are the ids of the picked rows;
- `x[ids]` and `index_select(x, 0, ids)` are x's rows picked: D = x;
- a row-wise op (torch's pointwise ops, `mm`/`addmm` with T as the rows, casts, `detach`, an
  `expand` to its own size) on picked rows is the op on D, picked;
- `index_add(base, 0, ids, T)` is base + where(mask, D, 0); `sum(T, [0])` is sum(where(mask, D, 0), [0]);
  `mm(T.t(), U)` (a weight's gradient) is mm(where(mask, D, 0).t(), where(mask, E, 0)).
Each step is exact, and the rows masked out reach a result only through `where`, which drops them,
so a proof of the dense form is a proof of the program. Size symbols feed only runtime assertions
(`_assert_scalar`), which cannot change a value and are dropped, and such expands. Any other use of
a data-dependent size is refused at its line, saying what to do.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

aten = torch.ops.aten
SIZE_OPS = (aten.sym_size.int, aten._assert_scalar.default, operator.ge, operator.le, operator.gt, operator.lt, operator.eq)
WHAT_TO_DO = (
    "shardproof proves a data-dependent size (`nonzero`, a boolean mask as an index) only where the rows it picks "
    "are computed row by row and then added back (`index_add`) or summed; write this step in fixed-shape form "
    "(multiply by the mask, `torch.where`), or dump it compiled without capture_dynamic_output_shape_ops"
)


@dataclass(frozen=True)
class Picked:
    """A value of data-dependent size: the ids of the rows `mask` picks, or those rows of `dense`."""

    mask: fx.Node
    dense: fx.Node | None = None  # None: the row ids
    transposed: bool = False  # the picked rows of a matrix, transposed: columns picked


def densify(graph: fx.Graph, refuse: Callable[[fx.Node, str], Exception]) -> None:
    """Rewrite the graph's data-dependent regions into their dense forms, in place."""
    picked: dict[fx.Node, Picked] = {}
    dropped: list[fx.Node] = []
    for node in list(graph.nodes):
        sized = [a for a in node.all_input_nodes if a in picked or _is_size(a)]
        if node.op == "call_function" and node.target is aten.nonzero.default:
            picked[node] = _nonzero(node, refuse)
        elif node.op == "output" or not (sized or _is_size(node)):
            if node.op == "output" and sized:
                raise refuse(node, f"program outputs of a fixed size (`{sized[0].name}` has a data-dependent one); {WHAT_TO_DO}")
            if node.meta.get("symbolic"):
                raise refuse(node, f"a fixed size, or the rows `nonzero` picks (`{node.meta['symbolic']}`); {WHAT_TO_DO}")
        elif node.target in SIZE_OPS:
            dropped.append(node)
        else:
            found = _dense(node, picked, refuse)
            if isinstance(found, Picked):
                picked[node] = found
            else:
                node.replace_all_uses_with(found)
                dropped.append(node)
    gone = {*picked, *dropped}
    for node in gone:
        for user in node.users:
            if user not in gone:
                raise refuse(user, f"a use of `{node.name}` of fixed size; {WHAT_TO_DO}")
    for node in reversed(list(graph.nodes)):
        if node in gone:
            graph.erase_node(node)


def _is_size(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.meta.get("size_symbol", False)


def _nonzero(node: fx.Node, refuse) -> Picked:
    mask = node.args[0]
    value = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise refuse(node, f"`nonzero` of a one-dimensional mask; {WHAT_TO_DO}")
    return Picked(mask)


def _dense(node: fx.Node, picked: dict[fx.Node, Picked], refuse) -> Picked | fx.Node:
    """The dense form of a node that uses picked values: Picked rows, or the node replacing it."""
    args, target = node.args, node.target
    uses = {picked[a].mask for a in node.all_input_nodes if a in picked}
    if len(uses) != 1:
        raise refuse(node, f"values picked by one mask, not {len(uses)}; {WHAT_TO_DO}")
    (mask,) = uses

    def ids(value: Any) -> bool:
        return isinstance(value, fx.Node) and value in picked and picked[value].dense is None

    def rows(value: Any) -> bool:
        return isinstance(value, fx.Node) and value in picked and picked[value].dense is not None and not picked[value].transposed

    if target is aten.select.int and args[0] in picked and tuple(args[1:]) == (1, 0):
        return Picked(mask)
    source, index = args[0], None
    if target is aten.index.Tensor and len(args[1]) == 1:
        index = args[1][0]
    elif target is aten.index_select.default and args[1] == 0:
        index = args[2]
    if ids(index) and source not in picked:
        if _shape(source)[:1] != _shape(mask):
            raise refuse(node, f"rows of a tensor of as many rows as the mask has elements; {WHAT_TO_DO}")
        return Picked(mask, source)
    if target is aten.expand.default and rows(args[0]) and _is_size(args[1][0]) and tuple(args[1][1:]) == _shape(picked[args[0]].dense)[1:]:
        return picked[args[0]]  # expanded to its own size
    if target is aten.t.default and rows(args[0]) and len(_shape(picked[args[0]].dense)) == 2:
        return Picked(mask, picked[args[0]].dense, transposed=True)
    if target is aten.mm.default and args[0] in picked and picked[args[0]].transposed and rows(args[1]):  # a sum over the picked rows
        columns = _new(node, aten.t.default, (_masked(node, mask, picked[args[0]].dense),))
        return _new(node, target, (columns, _masked(node, mask, picked[args[1]].dense)), refuse)
    if target is aten.index_add.default and len(args) == 4 and not node.kwargs and args[1] == 0 and ids(args[2]) and rows(args[3]):
        if args[0] in picked or _shape(args[0]) != _shape(picked[args[3]].dense):
            raise refuse(node, f"rows added back into a tensor of as many rows as the mask has elements; {WHAT_TO_DO}")
        return _new(node, aten.add.Tensor, (args[0], _masked(node, mask, picked[args[3]].dense)), refuse)
    if target is aten.sum.dim_IntList and len(args) == 2 and not node.kwargs and rows(args[0]) and list(args[1]) == [0]:
        return _new(node, target, (_masked(node, mask, picked[args[0]].dense), [0]), refuse)
    if _row_wise(node, picked, rows):
        dense = fx.node.map_arg(node.args, lambda a: picked[a].dense if rows(a) else a)
        return Picked(mask, _new(node, target, dense, refuse, node.kwargs))
    raise refuse(node, f"a row-wise op on `{next(a.name for a in node.all_input_nodes if a in picked or _is_size(a))}`; {WHAT_TO_DO}")


def _row_wise(node: fx.Node, picked: dict[fx.Node, Picked], rows: Callable[[Any], bool]) -> bool:
    """The op computes each picked row from that row alone: a pointwise op whose other tensor
    operands do not run along the rows, `mm` / `addmm` with the picked rows on the left, a cast."""
    target, args = node.target, node.args
    if any(a in picked and not rows(a) for a in node.all_input_nodes):  # row ids are no values
        return False
    if target is aten.mm.default:
        return rows(args[0]) and not rows(args[1])
    if target is aten.addmm.default:
        return rows(args[1]) and not rows(args[0]) and not rows(args[2])
    if target in (aten._to_copy.default, aten.detach.default):
        return True
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return False
    width = max(len(_shape(picked[a].dense)) for a in node.all_input_nodes if rows(a))
    return all(len(_shape(a)) < width or _shape(a)[0] == 1 for a in node.all_input_nodes if not rows(a))


def _masked(node: fx.Node, mask: fx.Node, dense: fx.Node) -> fx.Node:
    """where(mask, dense, 0), the mask along dense's rows."""
    shape = _shape(dense)
    column = _new(node, aten.view.default, (mask, [shape[0], *[1] * (len(shape) - 1)]))
    zeros = _new(node, aten.zeros_like.default, (dense,))
    return _new(node, aten.where.self, (column, dense, zeros))


def _new(like: fx.Node, target, args: tuple, refuse=None, kwargs: dict | None = None) -> fx.Node:
    """A node before `like`, at its line, its value computed by torch on meta tensors."""
    kwargs = dict(kwargs or {})
    values = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    try:
        value = target(*values[0], **values[1])
    except Exception as err:  # noqa: BLE001 - torch's check says what does not fit
        if refuse is None:
            raise
        raise refuse(like, f"operands its dense form accepts ({str(err).strip().splitlines()[0]}); {WHAT_TO_DO}") from None
    with like.graph.inserting_before(like):
        new = like.graph.create_node("call_function", target, args, kwargs, name=f"{like.name}_dense")
    new.meta.update({k: like.meta[k] for k in ("location", "dump_line") if k in like.meta}, val=value, dump_name=new.name)
    return new


def _shape(node: Any) -> tuple[int, ...]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()
