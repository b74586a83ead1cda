"""Import a PyTorch FX readable dump (`print_readable`, TORCH_COMPILE_DEBUG, AOTAutograd graphs).

The dump is Python source: `name: "f32[8, 16]" = torch.ops.aten.mm.default(a, b)` per node, with
`# File: path:line in fn, code: text` comments giving the source line of the nodes below them.
It is parsed with `ast` (never executed) back into a torch.fx graph whose nodes carry meta
tensors of the annotated shapes, so the aten lowering table of `ir/from_fx.py` applies unchanged;
fused kernels that only dumps contain (apex, vLLM, ...) are lowered by `fx_kernels.py`. Values of
data-dependent size (`i64[u0, 1]` from `nonzero`) get their dense form from `fx_unbacked.py`; the
graphs torch.compile broke a program into are chained by `fx_chain.py`.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

import torch
import torch.fx as fx

from shardproof.errors import CaseError, GraphFileError, UnsupportedOp
from shardproof.importers.fx_chain import Part, chain, describe
from shardproof.importers.fx_kernels import DumpLowerer, DumpOp
from shardproof.importers.fx_unbacked import densify
from shardproof.importers.graph_inputs import ImportedGraph
from shardproof.importers.text import read_text
from shardproof.ir.graph import Location

DTYPES = {
    "f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64, "b8": torch.bool,
    "i8": torch.int8, "u8": torch.uint8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
}  # fmt: skip
_FILE = re.compile(r"#\s*File: (?P<file>.+?):(?P<line>\d+) in (?P<fn>[^,]+), code: (?P<code>.*)$")
_ANNOTATION = re.compile(r"^(?P<dtype>[a-z]+\d*)\[(?P<dims>[\w, ]*)\]$")
_SIZE = re.compile(r"^Sym\(.*\)$")  # a size (`Sym(u0)`) or a fact about sizes (`Sym(u0 >= 0)`)
_UNBACKED = re.compile(r"^u\d+$")  # a size that depends on tensor values, as torch.compile names it
_OPERATORS = {
    ast.GtE: operator.ge, ast.LtE: operator.le, ast.Gt: operator.gt, ast.Lt: operator.lt, ast.Eq: operator.eq,
}  # fmt: skip


def load_fx(path: str, rank: int, world_size: int) -> ImportedGraph:
    """One dump on its own: every process group it names spans all `world_size` ranks."""
    graph, outputs = _parse(path)
    groups = {g: tuple(range(world_size)) for g in _group_names(graph)}
    return DumpLowerer(graph, outputs, path, rank, world_size, groups).run()


def load_fx_ranks(paths: list[list[str]]) -> tuple[list[ImportedGraph], dict[str, tuple[int, ...]], list[str]]:
    """The dumps of ranks 0..n-1 (each rank's graphs in order, chained into one), the ranks of each
    process group they name, and how the graphs were chained.

    A collective completes only when every rank of its group calls it, so a group's ranks are
    the ranks whose dumps name it (names are per process: rank 0's data-parallel group of one
    may be `1` and rank 1's `3`). A size the dump states (all-gather, reduce-scatter) must agree."""
    parsed = []
    for files in paths:
        parts = [Part.of(*_parse(path), path) for path in files]
        parsed.append((chain(parts), parts))
    if any(c.links != parsed[0][0].links for c, _ in parsed):
        raise CaseError(f"{paths[0][0]}: the ranks' graphs chain differently ({' vs '.join(str(c.links) for c, _ in parsed)})")
    members: dict[str, list[int]] = {}
    for rank, (chained, _) in enumerate(parsed):
        for g in _group_names(chained.graph):
            members.setdefault(g, []).append(rank)
    for rank, (chained, _) in enumerate(parsed):
        for g, size in _stated_group_sizes(chained.graph).items():
            if size != len(members[g]):
                raise UnsupportedOp(f"process group `{g}` of {size} ranks named by the dumps of ranks {members[g]} only", paths[rank][0])
    groups = {g: tuple(ranks) for g, ranks in members.items()}
    n = len(paths)
    graphs = [DumpLowerer(c.graph, c.names, files[0], r, n, groups).run() for r, (files, (c, _)) in enumerate(zip(paths, parsed))]
    chained, parts = parsed[0]
    return graphs, groups, [describe(link, parts) for link in chained.links]


def _parse(path: str) -> tuple[fx.Graph, list[str]]:
    return _Parser(read_text(path), path).parse()


def _collectives(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if _collective(n)]


def _collective_result(node: fx.Node, args: tuple) -> torch.Tensor | None:
    """What a functional collective returns, as a meta tensor: its input's shape, dim 0 times the
    group size for all_gather_into_tensor(x, size, group), divided by it for
    reduce_scatter_tensor(x, op, size, group); None when the arguments do not say."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.dim():
        return None
    name, rows = str(node.target), x.shape[0]
    if "all_gather_into_tensor" in name and isinstance(args[-2], int):
        rows *= args[-2]
    elif "reduce_scatter_tensor" in name and isinstance(args[-2], int) and args[-2] > 0 and rows % args[-2] == 0:
        rows //= args[-2]
    elif "all_gather" in name or "reduce_scatter" in name or "all_to_all" in name:
        return None
    return x.new_empty((rows, *x.shape[1:]))


def _collective(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(("_c10d_functional.", "vllm.all_reduce"))


def _group_names(graph: fx.Graph) -> set[str]:
    return {a for n in _collectives(graph) for a in n.args[1:] if isinstance(a, str) and a not in ("sum", "max", "min", "avg")}


def _stated_group_sizes(graph: fx.Graph) -> dict[str, int]:
    """all_gather_into_tensor(x, group_size, group) and reduce_scatter_tensor(x, op, group_size, group)."""
    sizes = {}
    for node in _collectives(graph):
        if str(node.target).startswith(("_c10d_functional.all_gather_into_tensor", "_c10d_functional.reduce_scatter_tensor")):
            sizes[node.args[-1]] = node.args[-2]
    return sizes


class _Parser:
    """Builds the fx.Graph statement by statement; every failure names the file and line."""

    def __init__(self, source: str, path: str):
        self.source, self.path = source, path
        self.graph = fx.Graph()
        self.env: dict[str, Any] = {}
        self.declared: dict[str, torch.Tensor] = {}  # pytree placeholders declared as `name: "type"`
        self.locations = _locations(source)
        self.output_names: list[str] = []
        self.joint = False  # an AOTAutograd joint forward + backward graph

    def fail(self, node: ast.AST, expected: str) -> GraphFileError:
        line = getattr(node, "lineno", 1)
        found = self.source.splitlines()[line - 1] if line <= len(self.source.splitlines()) else ""
        return GraphFileError(self.path, line, expected, found)

    def parse(self) -> tuple[fx.Graph, list[str]]:
        # print_readable names the class after the module, which may be no identifier (`<lambda>`)
        source = re.sub(r"^class [^(\n]+\(", "class _(", self.source, flags=re.MULTILINE)
        try:
            tree = ast.parse(source, self.path)
        except SyntaxError as err:
            raise GraphFileError(self.path, err.lineno or 1, f"Python syntax ({err.msg})", err.text or "") from None
        forward = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
        if forward is None:
            raise GraphFileError(self.path, 1, "a `def forward(self, ...)` holding the graph", "none")
        self.joint = [a.arg for a in forward.args.args[1:]] == ["primals", "tangents"]
        for arg in forward.args.args[1:]:
            if arg.annotation is not None:
                self.placeholder(arg.arg, self.meta(arg.annotation, arg))
        for statement in forward.body:
            self.statement(statement)
        if not any(n.op == "output" for n in self.graph.nodes):
            raise GraphFileError(self.path, self.source.count("\n") + 1, "`return [outputs]` ending forward", "end of file")
        densify(self.graph, lambda node, expected: self.mismatch(node, expected))
        self.check_values()
        return self.graph, self.output_names

    def check_values(self) -> None:
        """Every torch op run on its operands' meta tensors (torch's own shape checks): a node its
        operands do not fit, or whose annotation is not what the op computes, is refused at its
        line. A multi-output op, which has no annotation of its own, gets the tuple make_fx would
        have recorded."""
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is operator.getitem:
                self.check_item(node)
                continue
            # an operand node without a value is marked; a literal None argument stays, for torch to judge
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _NO_VALUE if n.meta.get("val") is None else n.meta["val"])
            if _collective(node):  # not run: torch resolves its group by a name no dump registers here
                self.check_declared(node, _collective_result(node, args))
                continue
            if not isinstance(node.target, torch._ops.OpOverload) or any(v is _NO_VALUE for v in _leaves(args, kwargs)):
                continue  # a kernel not loaded here, or an operand without a value: the lowering decides
            kwargs = {**kwargs, **({"device": "meta"} if "device" in kwargs else {})}
            try:
                computed = node.target(*args, **kwargs)
            except NotImplementedError:
                continue  # no meta kernel
            except Exception as err:  # noqa: BLE001 - torch's check says what does not fit
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise self.mismatch(node, f"operands that `{_short(node.target)}` accepts ({reason})") from None
            self.check_declared(node, computed)

    def check_item(self, node: fx.Node) -> None:
        container, index = node.args
        values = container.meta.get("val") if isinstance(container, fx.Node) else None
        if not isinstance(values, (tuple, list)):
            return
        if not isinstance(index, int) or not -len(values) <= index < len(values):
            raise self.mismatch(node, f"an index into the {len(values)} outputs of `{container.name}`")
        self.check_declared(node, values[index])

    def check_declared(self, node: fx.Node, computed: Any) -> None:
        declared = node.meta.get("val")
        if computed is None:
            return
        if declared is None:
            node.meta["val"] = computed
        elif not isinstance(computed, torch.Tensor) or (computed.shape, computed.dtype) != (declared.shape, declared.dtype):
            what = _annotation(computed) if isinstance(computed, torch.Tensor) else f"a {type(computed).__name__}"
            raise self.mismatch(node, f'the annotation "{_annotation(declared)}" to be what the op computes, {what}')

    def mismatch(self, node: fx.Node, expected: str) -> GraphFileError:
        line = node.meta["dump_line"]
        return GraphFileError(self.path, line, expected, self.source.splitlines()[line - 1])

    def placeholder(self, name: str, val: torch.Tensor) -> None:
        node = self.graph.placeholder(name)
        node.meta.update(val=val, dump_name=name)
        self.env[name] = node

    def annotated(self, annotation: ast.AST, where: ast.AST) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """A statement's value as a meta tensor, and what to mark its node with: a size
        (`Sym(u0)`, `Sym(u0 >= 0)`) or a tensor of a data-dependent size (`i64[u0, 1]`) has no
        meta tensor, and is marked for `fx_unbacked.py`."""
        text = annotation.value.strip() if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str) else ""
        if _SIZE.match(text):
            return None, {"symbolic": text, "size_symbol": True}
        match = _ANNOTATION.match(text)
        sizes = [d.strip() for d in match["dims"].split(",") if d.strip()] if match else []
        if any(_UNBACKED.match(d) for d in sizes) and all(d.isdigit() or _UNBACKED.match(d) for d in sizes):
            return None, {"symbolic": text}
        return self.meta(annotation, where), {}

    def meta(self, annotation: ast.AST, where: ast.AST) -> torch.Tensor:
        text = annotation.value if isinstance(annotation, ast.Constant) else None
        match = _ANNOTATION.match(text.strip()) if isinstance(text, str) else None
        if match is None or match["dtype"] not in DTYPES:
            raise self.fail(where, 'a tensor annotation like "f32[8, 16]"')
        sizes = [d.strip() for d in match["dims"].split(",") if d.strip()]
        if not all(d.isdigit() for d in sizes):  # `s0`: a graph compiled for dynamic shapes
            raise self.fail(where, "fixed sizes (compile with dynamic=False), or sizes that depend on tensor values (`u0`)")
        dims = tuple(int(d) for d in sizes)
        try:
            return torch.empty(dims, dtype=DTYPES[match["dtype"]], device="meta")
        except RuntimeError:  # more elements than an address can count
            raise self.fail(where, "a tensor annotation of a size that fits in memory") from None

    def statement(self, st: ast.stmt) -> None:
        if isinstance(st, ast.AnnAssign) and st.value is None and isinstance(st.target, ast.Name):
            self.declared[st.target.id] = self.meta(st.annotation, st)
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            self.assign(st.target.id, st.value, *self.annotated(st.annotation, st), st)
        elif isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Tuple):
            self.flattened_inputs(st)
        elif isinstance(st, ast.Assign) and all(isinstance(t, ast.Name) for t in st.targets):
            if not (isinstance(st.value, ast.Constant) and st.value.value is None):  # `a = b = None`: frees
                self.assign(st.targets[0].id, st.value, None, {}, st)
        elif isinstance(st, ast.Return):
            self.output(st)
        elif not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):
            raise self.fail(st, "an assignment `name = torch.ops...(...)` or `return [...]`")

    def flattened_inputs(self, st: ast.Assign) -> None:
        """`primals_1, primals_2, ... = fx_pytree.tree_flatten_spec([primals, tangents], ...)`."""
        for element in st.targets[0].elts:
            if not isinstance(element, ast.Name) or element.id not in self.declared:
                raise self.fail(st, "names declared with a type annotation before they are unpacked")
            self.placeholder(element.id, self.declared[element.id])

    def assign(self, name: str, value: ast.expr, val: torch.Tensor | None, marks: dict[str, Any], st: ast.stmt) -> None:
        if name in self.env:  # a graph names each value once
            raise self.fail(st, f"a new name (`{name}` is assigned above)")
        if isinstance(value, ast.Subscript):
            args = (self.expr(value.value), self.expr(value.slice))
            node = self.graph.create_node("call_function", operator.getitem, args, {}, name=name)
        elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
            node = self.graph.create_node("get_attr", value.attr, name=name)
        elif isinstance(value, ast.Call):
            target = self.target(value.func, st)
            args = tuple(self.expr(a) for a in value.args)
            kwargs = {k.arg: self.expr(k.value) for k in value.keywords}
            node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        elif isinstance(value, ast.Compare) and len(value.ops) == 1 and type(value.ops[0]) in _OPERATORS:
            args = (self.expr(value.left), self.expr(value.comparators[0]))
            node = self.graph.create_node("call_function", _OPERATORS[type(value.ops[0])], args, {}, name=name)
        elif isinstance(value, ast.Name) and value.id in self.env:
            self.env[name] = self.env[value.id]
            return
        else:
            raise self.fail(st, "a call of a torch.ops operator, an item `x[0]`, or `self.<constant>`")
        node.meta.update(dump_name=name, location=self.locations.get(st.lineno), dump_line=st.lineno)
        if val is not None:
            node.meta["val"] = val
        node.meta.update(marks)
        self.env[name] = node

    def target(self, func: ast.expr, st: ast.stmt) -> Any:
        dotted = _dotted(func)
        if dotted is None or not dotted.startswith("torch.ops."):
            raise self.fail(st, "a call of a `torch.ops.<namespace>.<op>.<overload>` operator")
        qualified = dotted.removeprefix("torch.ops.")
        try:
            found: Any = torch.ops
            for part in qualified.split("."):
                found = getattr(found, part)
            return found if isinstance(found, torch._ops.OpOverload) else DumpOp(qualified)
        except (AttributeError, RuntimeError):
            return DumpOp(qualified)  # a kernel from a library not loaded here (apex, vLLM, ...)

    def expr(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.expr(e) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.expr(node.operand)
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            if node.id in ("inf", "nan"):
                return float(node.id)
            raise self.fail(node, f"a name defined earlier in the graph (`{node.id}` is not)")
        dotted = _dotted(node.func if isinstance(node, ast.Call) else node)
        if isinstance(node, ast.Call) and dotted == "device":
            return "cpu"  # devices do not change what is computed
        if dotted is not None and dotted.startswith("torch.ops."):
            return self.target(node, node)
        if dotted is not None and dotted.startswith("torch."):
            return getattr(torch, dotted.removeprefix("torch."), dotted)  # dtypes, layouts, memory formats
        raise self.fail(node, "a literal, a list, a graph value or a torch constant")

    def output(self, st: ast.Return) -> None:
        value = st.value
        if isinstance(value, ast.Call) and value.args:  # pytree.tree_unflatten([...], self._out_spec)
            value = value.args[0]
        if isinstance(value, ast.Name):
            value = ast.List([value], ast.Load())
        if not isinstance(value, (ast.List, ast.Tuple)):
            raise self.fail(st, "`return [outputs]`")
        kept = [i for i, e in enumerate(value.elts) if not (isinstance(e, ast.Constant) and e.value is None)]
        self.output_names = [e.id if isinstance(e, ast.Name) else "" for e in (value.elts[i] for i in kept)]
        node = self.graph.output([self.expr(value.elts[i]) for i in kept])
        node.meta["dump_line"] = st.lineno
        gradient_of = self.gradients(len(value.elts))
        node.meta["gradient_of"] = {k: gradient_of[i] for k, i in enumerate(kept) if i in gradient_of}

    def gradients(self, outputs: int) -> dict[int, str]:
        """Output position -> the input it is the gradient of. An AOTAutograd joint graph,
        `forward(self, primals, tangents)`, returns the forward's outputs and then one gradient per
        primal in order (None for a primal that needs none)."""
        if not self.joint:
            return {}
        primals = [n.meta["dump_name"] for n in self.graph.nodes if n.op == "placeholder" and n.meta["dump_name"].startswith("primals")]
        start = outputs - len(primals)
        return {start + k: name for k, name in enumerate(primals)} if start >= 0 else {}


_NO_VALUE = object()  # an operand node whose value the dump does not give


def _leaves(*values: Any) -> list[Any]:
    return [x for v in values for x in (_leaves(*(v.values() if isinstance(v, dict) else v)) if isinstance(v, (list, tuple, dict)) else [v])]


def _short(target: Any) -> str:
    return str(target).removeprefix("aten.")


def _annotation(value: torch.Tensor) -> str:
    """A tensor as a dump annotates it: `f32[8, 16]`."""
    dtype = next((k for k, v in DTYPES.items() if v == value.dtype), str(value.dtype).removeprefix("torch."))
    return f"{dtype}[{', '.join(str(d) for d in value.shape)}]"


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _locations(source: str) -> dict[int, Location | None]:
    """Line number -> the `# File:` comment in force there (comments set it for the lines below)."""
    found: dict[int, Location | None] = {}
    current = None
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        match = _FILE.search(stripped)
        if match is not None:
            current = Location(match["file"], int(match["line"]), match["code"].strip())
        elif stripped.startswith("# No stacktrace"):
            current = None
        found[number] = current
    return found
