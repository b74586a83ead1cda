"""Split sizes read off the routing (`.tolist()` of expert counts, torchtitan's all_to_all token
dispatcher): the variable-size exchange rewritten into fixed-size buffers with masks as data, the
form `examples/moe_ep.py` is proven in for every routing.

make_fx with `capture_scalar_outputs` traces `.tolist()` into unbacked sizes (`u0`). The pieces the
dispatcher cuts are segments of (rank, expert) pairs; each is rewritten into a fixed buffer and a
mask, never specialised on the traced values:
- rows sorted by a stable argsort of keys k (`x[order // K]`, `g[order]`) are a sorted form of their
  pair-space tensor D (row i of D: pair i); a pointwise or row-wise op on sorted forms of the same
  order is the op on the Ds, sorted;
- counts made by `scatter_add` of ones at k into zeros of E are each key's count (and every key is
  in [0, E): the scatter fails otherwise); views, sums along a dim and `.item()` move, add and read
  them; a fixed `all_to_all` of such a histogram, as made, gives peer j's counts of this rank's keys,
  j's own rewriting checking that they count the keys j sends;
- with splits that are those counts, the segment of rows of key e (stable sort) is D[k == e] in
  D's order, so a variable `all_to_all` of sorted rows is the fixed one of every rank's D and k to
  every rank (each piece masked by the receiver's keys), `split` / `cat` regroup segments, and a
  row-wise op on a segment is the op on its buffer (`where(mask, ...)` keeps only its rows);
- sent back (split lists swapped), each peer's parts are summed into one buffer of the sender's pairs
  (zero outside their masks); the peers' blocks of keys cover every key once, in ascending order,
  so the sum of the buffers coming back is the sorted rows' pair-space tensor;
- `index_add` of sorted rows at sorted ids is `index_add` of the Ds at the ids (a sum does not
  depend on the order of its terms); an op this rewriting does not know reads sorted rows as they
  are, D[order].
Every rank is taken to hold as many pairs (the fixed exchanges cut equal pieces). Anything else that reads a data-dependent size is refused at its line, saying what to do.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WHAT_TO_DO = (
    "shardproof reads split sizes off the routing only as counts of keys sorted by a stable argsort "
    "(torchtitan's all_to_all token dispatch); send fixed-size buffers with the gates as data "
    "(zero where a token is not routed), as `examples/moe_ep.py` does, proven for every routing"
)


@dataclass(frozen=True)
class Count:
    """How many pairs (rank, key) of `cells` there are: rank's pairs whose key is key (each rank's
    keys tensor is `source` of its own graph)."""

    cells: frozenset[tuple[int, int]]
    source: fx.Node

    def __add__(self, other: "Count") -> "Count":
        if other.source is not self.source or self.cells & other.cells:
            raise ValueError("counts of other keys or overlapping ones added")
        return Count(self.cells | other.cells, self.source)

    @property
    def ranks(self) -> set[int]:
        return {r for r, _ in self.cells}

    @property
    def keys(self) -> list[int]:
        return sorted(k for _, k in self.cells)


def _count(rank: int, key: int, source: fx.Node) -> Count:
    return Count(frozenset([(rank, key)]), source)


def _cell(value: Any) -> np.ndarray:
    """A 0-d object array of `value` (numpy hands single elements out bare)."""
    if isinstance(value, np.ndarray):
        return value
    held = np.empty((), dtype=object)
    held[()] = value
    return held


@dataclass(frozen=True)
class Order:
    """The stable argsort of `keys`."""

    keys: fx.Node


@dataclass(frozen=True)
class Sorted:
    """dense[order]: a pair-space tensor's rows in the order of the stable argsort of `keys`."""

    dense: fx.Node
    keys: fx.Node


@dataclass(frozen=True)
class Part:
    """dense[mask], `count` rows: one (rank, key) segment as a fixed buffer and its mask."""

    count: Count
    dense: fx.Node
    mask: fx.Node


@dataclass(frozen=True)
class Segments:
    """The parts concatenated in order (a variable number of rows)."""

    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Size:
    """A Python int read off a count (`.item()`, `.tolist()`): an unbacked size."""

    count: Count


class Densifier:
    """One rank's graph (`rank` of `world`) rewritten in place into fixed-shape form."""

    def __init__(self, graph: fx.Graph, rank: int, world: int, refuse: Callable[[fx.Node, str], Exception]):
        self.graph, self.rank, self.world, self.refuse = graph, rank, world, refuse
        self.known: dict[fx.Node, Any] = {}  # node -> Order, Sorted, Segments, Size, a count array, or a list of those
        self.views: dict[tuple, fx.Node] = {}  # (base, shape) -> the first view of base to shape
        self.orders: dict[fx.Node, fx.Node] = {}  # keys -> their stable argsort
        tensors = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.mode = torch._guards.detect_fake_mode(tensors)

    def run(self) -> None:
        dropped: list[fx.Node] = []
        for node in list(self.graph.nodes):
            if node.op != "call_function":
                if node.op == "output" and any(self._variable(a) for a in node.all_input_nodes):
                    raise self.refuse(node, f"program outputs of a fixed size; {WHAT_TO_DO}")
                continue
            found = self._step(node)
            if found is None:
                self._materialize_sorted(node)
                if not any(self._variable(a) for a in node.all_input_nodes) and self._variable(node):
                    node.meta["val"] = self._value(node.target, node.args, node.kwargs)  # of the rows as they are
                read = [a for a in node.all_input_nodes if self._variable(a)]
                if read or self._variable(node):
                    what = f"a use of `{read[0].name}`" if read else "a value read off a tensor"
                    raise self.refuse(node, f"{what} this rewriting knows; {WHAT_TO_DO}")
                continue
            if isinstance(found, fx.Node):
                node.replace_all_uses_with(found)
                dropped.append(node)
            else:
                self.known[node] = found
                if self._variable(node):
                    dropped.append(node)
        for node in reversed(list(self.graph.nodes)):
            if (node in dropped or node in self.known) and not node.users:
                self.graph.erase_node(node)
        left = [n for n in self.graph.nodes if n in dropped]
        if left:
            raise self.refuse(next(iter(left[0].users)), f"a use of `{left[0].name}` of fixed size; {WHAT_TO_DO}")

    def _materialize_sorted(self, node: fx.Node) -> None:
        """An op this rewriting does not know reads sorted rows as they are: dense[order]."""
        for a in node.all_input_nodes:
            value = self.known.get(a)
            if isinstance(value, Sorted):
                if value.keys not in self.orders:
                    raise self.refuse(node, f"sorted rows used where the sort's order is not taken; {WHAT_TO_DO}")
                node.replace_input_with(a, self._new(node, aten.index.Tensor, (value.dense, [self.orders[value.keys]])))

    def _canon(self, node: fx.Node) -> fx.Node:
        """One node for views of one tensor to one shape (make_fx traces each `.view(-1)` anew)."""
        if node.target is not aten.view.default:
            return node
        return self.views.setdefault((node.args[0], tuple(node.args[1])), node)

    def _variable(self, node: fx.Node) -> bool:
        """Its value has a data-dependent size (or is such a size): it cannot stay in the graph."""
        value = node.meta.get("val")
        found = self.known.get(node)
        if isinstance(found, (Segments, Size)) or isinstance(found, list) and any(isinstance(f, (Segments, Size)) for f in found):
            return True
        values = value if isinstance(value, (list, tuple)) else [value]
        return any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or isinstance(v, torch.Tensor) and not _static(v)
                   for v in values)

    # --- one node ---------------------------------------------------------------------------------
    def _step(self, node: fx.Node) -> Any:
        target, args = node.target, node.args
        known = [a for a in node.all_input_nodes if a in self.known]
        if target is aten.sort.stable and self._stable_sort(node):
            keys = self._canon(args[0])
            return [Sorted(keys, keys), Order(keys)]
        if target is operator.getitem and args[0] in self.known and isinstance(self.known[args[0]], list):
            found = self.known[args[0]][args[1]]
            if isinstance(found, Order):
                self.orders.setdefault(found.keys, node)
            return found
        if target is aten.scatter_add.default and self._histogram(node):
            return np.array([_count(self.rank, e, self._canon(args[2])) for e in range(_shape(node)[0])], dtype=object)
        if not known:
            return None
        counts = self._counts(node)
        if counts is not None:
            return counts
        if target is c10d.all_to_all_single.default and args[0] in self.known:
            return self._exchange(node)
        if target is c10d.wait_tensor.default:
            return self.known[args[0]]
        if target is aten.split_with_sizes.default:
            return self._split(node)
        if target is aten.cat.default and all(a in self.known and isinstance(self.known[a], Segments) for a in args[0]):
            return Segments(tuple(p for a in args[0] for p in self.known[a].parts))
        if target is aten.index.Tensor and len(args[1]) == 1 and args[1][0] in self.known and args[0] not in self.known:
            ids = self.known[args[1][0]]
            if isinstance(ids, Order) and _shape(args[0])[:1] == _shape(ids.keys):
                return Sorted(args[0], ids.keys)
            if isinstance(ids, Sorted):
                return Sorted(self._new(node, target, (args[0], [ids.dense])), ids.keys)
        if target is aten.index_add.default and len(args) == 4 and args[1] == 0 and args[0] not in self.known:
            ids, rows = (self.known.get(a) for a in args[2:])
            if isinstance(ids, Sorted) and isinstance(rows, Sorted) and ids.keys is rows.keys:
                return self._new(node, target, (args[0], 0, ids.dense, rows.dense))  # the sum in any order
        if target is aten.floor_divide.default and isinstance(self.known[args[0]], Order):
            keys = self.known[args[0]].keys
            positions = self._new(node, aten.arange.default, (_shape(keys)[0],), {"dtype": torch.long})
            return Sorted(self._new(node, target, (positions, args[1])), keys)
        return self._row_wise(node)

    def _stable_sort(self, node: fx.Node) -> bool:
        """sort(k, stable=True) ascending of a 1-D k: equal keys keep their order."""
        kwargs = node.kwargs
        return (len(node.args) == 1 and kwargs.get("stable") is True and not kwargs.get("descending", False)
                and kwargs.get("dim", -1) in (-1, 0) and len(_shape(node.args[0])) == 1)

    def _histogram(self, node: fx.Node) -> bool:
        """scatter_add(zeros(E), 0, k, ones_like(k)) for a 1-D k: each key's count."""
        base, dim, index, src = node.args
        return (dim == 0 and isinstance(base, fx.Node) and base.target is aten.zeros.default and len(_shape(base)) == 1
                and isinstance(src, fx.Node) and src.target is aten.ones_like.default and _same_tensor(src.args[0], index)
                and len(_shape(index)) == 1)

    def _counts(self, node: fx.Node) -> Any:
        """Count arrays moved or added: views, transposes, sums along dims, unbind, a fixed all_to_all, item."""
        target, args = node.target, node.args
        value = self.known.get(args[0]) if isinstance(args[0], fx.Node) else None
        if not isinstance(value, np.ndarray):
            return None
        try:
            if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
                return value.reshape(_shape(node))
            if target is aten.t.default:
                return value.T
            if target is aten.permute.default:
                return value.transpose(args[1])
            if target in (aten.clone.default, c10d.wait_tensor.default):
                return value
            if target is aten.sum.dim_IntList and len(args) == 2 and not node.kwargs:
                return _cell(np.add.reduce(value, axis=tuple(args[1])))
            if target is aten.unbind.int:
                return [_cell(v) for v in np.moveaxis(value, args[1] if len(args) > 1 else 0, 0)]
            if target is aten.select.int:
                return _cell(np.take(value, args[2], axis=args[1]))
            if target is aten._local_scalar_dense.default and value.ndim == 0:
                return Size(value.item())
            if (target is c10d.all_to_all_single.default and value.ndim == 1 and _even(args[1]) and _even(args[2])
                    and _whole_world(args[3])):
                # peers' counts are labelled as this rank's: only a histogram as made (key e at e) is sent,
                # which each peer's own rewriting checks of what it sends
                if [c.cells for c in value] != [frozenset([(self.rank, e)]) for e in range(len(value))]:
                    return None
                piece = len(value) // self.world
                mine = value[self.rank * piece : (self.rank + 1) * piece]
                return np.array([Count(frozenset((j, k) for _, k in c.cells), c.source) for j in range(self.world) for c in mine], dtype=object)
        except ValueError:
            return None
        return None

    def _sizes(self, node: fx.Node, sizes: Any) -> list[Count]:
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, fx.Node) and isinstance(self.known.get(s), Size) for s in sizes):
            raise self.refuse(node, f"split sizes read off counts of keys; {WHAT_TO_DO}")
        return [self.known[s].count for s in sizes]

    def _blocks(self, node: fx.Node, counts: list[Count]) -> list[list[int]]:
        """The key blocks of split sizes that cut this rank's sorted rows by destination: ascending,
        contiguous, together every key (one block per member of the group)."""
        flat = [k for c in counts for k in c.keys]
        if len(counts) != self.world or flat != list(range(len(flat))) or any(c.ranks != {self.rank} for c in counts):
            raise self.refuse(node, f"split sizes that are this rank's counts of consecutive keys, in order; {WHAT_TO_DO}")
        return [c.keys for c in counts]

    def _exchange(self, node: fx.Node) -> Any:
        """A variable all_to_all as the fixed one of every rank's buffers, segments masked by keys."""
        source, outputs, inputs, group = node.args
        value = self.known[source]
        if not _whole_world(group):
            raise self.refuse(node, f"an all_to_all over every rank; {WHAT_TO_DO}")
        sent, received = self._sizes(node, inputs), self._sizes(node, outputs)
        if isinstance(value, Sorted):
            mine = self._blocks(node, sent)[self.rank]
            if any(c.source is not value.keys for c in sent + received):  # peers' counts: of the keys they send
                raise self.refuse(node, f"rows sorted by the keys their split sizes count; {WHAT_TO_DO}")
            if [c.cells for c in received] != [frozenset((j, k) for k in mine) for j in range(self.world)]:
                raise self.refuse(node, f"receive sizes that are each peer's count of this rank's keys; {WHAT_TO_DO}")
            rows, keys = self._everyones(node, value.dense, group), self._everyones(node, value.keys, group)
            parts = []
            for j in range(self.world):
                dense, theirs = rows[j], keys[j]
                for e in mine:
                    parts.append(Part(_count(j, e, value.keys), dense, self._new(node, aten.eq.Scalar, (theirs, e))))
            return Segments(tuple(parts))
        if isinstance(value, Segments):
            return self._return(node, value, sent, received, group)
        raise self.refuse(node, f"an all_to_all of sorted rows or of segments; {WHAT_TO_DO}")

    def _return(self, node: fx.Node, value: Segments, sent: list[Count], received: list[Count], group: Any) -> Any:
        """Segments sent back to the ranks their rows came from: each peer's parts summed into one
        buffer of its pairs (their masks are disjoint), exchanged fixed. Piece d holds this rank's
        pairs with keys of d's block and zeros elsewhere, and the blocks cover every key once in
        ascending order: the pieces' sum is the rows in sorted order, as a pair-space tensor."""
        parts, buffers = list(value.parts), []
        for j, count in enumerate(sent):
            mine, parts = parts[: len(count.cells)], parts[len(count.cells) :]
            if count.ranks != {j} or frozenset(c for p in mine for c in p.count.cells) != count.cells:
                raise self.refuse(node, f"segments sent back to the ranks their rows came from; {WHAT_TO_DO}")
            buffers.append(self._summed(node, mine))
        if parts or len({_shape(b) for b in buffers}) != 1:
            raise self.refuse(node, f"segments sent back to the ranks their rows came from; {WHAT_TO_DO}")
        self._blocks(node, received)
        back = self._pieces(node, self._fixed_exchange(node, self._new(node, aten.cat.default, (buffers,)), group))
        total = back[0]
        for piece in back[1:]:
            total = self._new(node, aten.add.Tensor, (total, piece))
        return Sorted(total, received[0].source)

    def _summed(self, node: fx.Node, parts: list[Part]) -> fx.Node:
        total = None
        for part in parts:
            masked = self._masked(node, part)
            total = masked if total is None else self._new(node, aten.add.Tensor, (total, masked))
        return total

    def _masked(self, node: fx.Node, part: Part) -> fx.Node:
        shape = _shape(part.dense)
        column = self._new(node, aten.view.default, (part.mask, [shape[0], *[1] * (len(shape) - 1)]))
        zeros = self._new(node, aten.zeros_like.default, (part.dense,))
        return self._new(node, aten.where.self, (column, part.dense, zeros))

    def _everyones(self, node: fx.Node, dense: fx.Node, group: Any) -> list[fx.Node]:
        """Every rank's `dense`, by a fixed all_to_all of it repeated."""
        return self._pieces(node, self._fixed_exchange(node, self._new(node, aten.cat.default, ([dense] * self.world,)), group))

    def _pieces(self, node: fx.Node, exchanged: fx.Node) -> list[fx.Node]:
        """The pieces of a fixed all_to_all's output, one per member, as row ranges."""
        rows = _shape(exchanged)[0] // self.world
        return [self._new(node, aten.slice.Tensor, (exchanged, 0, j * rows, (j + 1) * rows)) for j in range(self.world)]

    def _fixed_exchange(self, node: fx.Node, sent: fx.Node, group: Any) -> fx.Node:
        """all_to_all_single of `sent` in equal pieces, one per member."""
        splits = [_shape(sent)[0] // self.world] * self.world
        return self._new(node, c10d.wait_tensor.default, (self._new(node, c10d.all_to_all_single.default, (sent, splits, splits, group)),))

    def _split(self, node: fx.Node) -> list[Segments]:
        value = self.known.get(node.args[0])
        if not isinstance(value, Segments) or node.kwargs or len(node.args) != 2:
            raise self.refuse(node, f"a split of segments along dim 0; {WHAT_TO_DO}")
        parts, pieces = list(value.parts), []
        for count in self._sizes(node, node.args[1]):
            taken, total = [], None
            while parts and (total is None or total != count):
                taken.append(parts.pop(0))
                try:
                    total = taken[-1].count if total is None else total + taken[-1].count
                except ValueError:
                    break
            if total != count:
                raise self.refuse(node, f"split sizes that add up consecutive segments' counts; {WHAT_TO_DO}")
            pieces.append(Segments(tuple(taken)))
        if parts:
            raise self.refuse(node, f"split sizes that add up consecutive segments' counts; {WHAT_TO_DO}")
        return pieces

    def _row_wise(self, node: fx.Node) -> Any:
        """A pointwise op, `mm` by a fixed matrix, an unsqueeze, on sorted rows of one order or on one
        segmented value: the op on each buffer (each row computed from its own row alone)."""
        target, args = node.target, node.args
        values = {a: self.known[a] for a in node.all_input_nodes if a in self.known}
        if not _row_wise(node, set(values)):
            return None
        if all(isinstance(v, Sorted) for v in values.values()) and len({v.keys for v in values.values()}) == 1:
            keys = next(iter(values.values())).keys
            dense = fx.node.map_arg(args, lambda a: values[a].dense if a in values else a)
            return Sorted(self._new(node, target, dense, node.kwargs), keys)
        if len(values) == 1 and isinstance(next(iter(values.values())), Segments):
            (segmented, value), = values.items()
            return Segments(tuple(Part(p.count, self._new(node, target, fx.node.map_arg(args, lambda a: p.dense if a is segmented else a), node.kwargs), p.mask)
                                  for p in value.parts))
        return None

    def _new(self, like: fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """A node before `like`, at its line, its value computed by torch on fake tensors."""
        kwargs = dict(kwargs or {})
        value = self._value(target, args, kwargs)
        with like.graph.inserting_before(like):
            new = like.graph.create_node("call_function", target, args, kwargs, name=f"{like.name}_dense")
        new.meta.update({k: like.meta[k] for k in ("stack_trace", "location") if k in like.meta}, val=value)
        return new

    def _value(self, target: Any, args: Any, kwargs: Any) -> Any:
        """What the op computes from its arguments' traced values, on fake tensors."""
        values = fx.node.map_arg((args, dict(kwargs)), lambda a: a.meta["val"])
        with self.mode:
            return target(*values[0], **values[1])


def _row_wise(node: fx.Node, rows: set[fx.Node]) -> bool:
    target, args = node.target, node.args
    if target is aten.mm.default:
        return args[0] in rows and args[1] not in rows
    if target is aten.unsqueeze.default:
        return args[1] not in (0, -len(_shape(node)))
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return False
    width = max(len(_shape(a)) for a in rows)
    return all(len(_shape(a)) < width or _shape(a)[0] == 1 for a in node.all_input_nodes if a not in rows)


def _whole_world(group: Any) -> bool:
    """The group (a c10d group name) holds every rank in order: its positions are the ranks."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    ranks = dist.get_process_group_ranks(_resolve_process_group(group)) if isinstance(group, str) else None
    return ranks == list(range(dist.get_world_size()))


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in value.shape)


def _even(splits: Any) -> bool:
    return splits is None or isinstance(splits, (list, tuple)) and len(set(splits)) <= 1 and all(isinstance(s, int) for s in splits)


def _same_tensor(a: Any, b: Any) -> bool:
    """The same node, or views of one node to the same shape (make_fx traces each `.view(-1)` anew)."""
    if a is b:
        return True
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.target is b.target is aten.view.default
            and a.args[0] is b.args[0] and tuple(a.args[1]) == tuple(b.args[1]))


def _shape(node: Any) -> tuple[int, ...]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()
