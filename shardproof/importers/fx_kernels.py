"""Lowering of FX readable dumps: the aten table of `ir/from_fx.py`, plus the ops that only dumps
of real training and serving stacks contain, each spelled in primitive IR ops.

Fused kernels (apex layer norm forward and backward, vLLM's RMS norms, SwiGLU, rotary embedding
and attention) and the backward and indexing aten ops of AOTAutograd joint graphs that the core table lacks are
lowered to their arithmetic, so the existing rules reason about them. `auto_functionalized` wrappers return
the new values of the arguments the wrapped kernel mutates, in order.

Modelling choices, stated because the dump cannot show them: dropout is the identity (its random
mask is not part of the proof); vLLM's attention kernel is causal softmax attention per head (its
sequence metadata is not in the graph); a tensor constant whose value the dump omits is an input,
matched to the reference's, unless its source line assigns a literal (`x[mask] = 0.0`); its
candidate values are inferred later (`constants.py`).
"""

from __future__ import annotations

import math
import re
import types
from typing import Any, Callable

import torch
import torch.fx as fx

from shardproof.errors import GraphFileError, UnsupportedOp
from shardproof.importers.graph_inputs import GraphInput, ImportedGraph
from shardproof.ir import from_fx
from shardproof.ir.build import GraphBuilder
from shardproof.ir.from_fx import Lowerer, gathered, slice_value
from shardproof.ir.graph import Location
from shardproof.ir.ops import OPS

Value = Any


class DumpOp:
    """An operator of a library not loaded here (apex, vLLM, ...), known by its qualified name."""

    def __init__(self, qualified: str):
        self.qualified = qualified
        self.__name__ = qualified.replace(".", "_")

    def __str__(self) -> str:
        return self.qualified

    __repr__ = __str__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.qualified} is only lowered, never run")


class DumpLowerer(Lowerer):
    """The aten Lowerer with the dump-only ops, unknown constants as inputs, and collectives over
    all ranks of the dump (a single-rank collective is the identity)."""

    def __init__(
        self, graph: fx.Graph, output_names: list[str], path: str, rank: int, world_size: int,
        groups: dict[str, tuple[int, ...]],
    ):  # fmt: skip
        self.world_size = world_size
        names = [n.meta["dump_name"] for n in graph.nodes if n.op == "placeholder"]
        super().__init__(
            types.SimpleNamespace(graph=graph), names, _locate, [], lambda g: groups[g], rank if world_size > 1 else None
        )
        gradient_of = next(n for n in graph.nodes if n.op == "output").meta.get("gradient_of", {})
        self.imported = ImportedGraph(self.graph, path, output_names=output_names, gradient_of=gradient_of)

    def run(self) -> ImportedGraph:
        super().run()
        leaves = [n for n in self.graph.nodes if n.op == "leaf"]
        constants = {i.name for i in self.imported.inputs}
        self.imported.inputs = [GraphInput(n.attrs[0], n.id, n.shape, n.dtype, n.attrs[0] in constants) for n in leaves]
        return self.imported

    def call(self, node: fx.Node) -> Value:
        """The node's IR; arguments its lowering cannot read are the dump's fault, refused at its line."""
        try:
            return super().call(node)
        except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError, RuntimeError) as err:
            line = node.meta.get("dump_line", 1)
            raise GraphFileError(node.meta.get("dump_path", self.imported.path), line, f"arguments `{node.target}` can take ({type(err).__name__}: {err})", node.name) from None

    def emit(self, op: str, inputs: tuple[int, ...], attrs: tuple = (), shape=None, dtype=None) -> int:
        if OPS[op].kind == "collective" and len(attrs[-1]) == 1:
            return inputs[0]
        return super().emit(op, inputs, attrs, shape, dtype)

    def builder(self) -> GraphBuilder:
        """A builder that names and locates nodes like the FX node being lowered."""
        b = GraphBuilder(self.graph)
        b.at(self.current.name, self.locate(self.current))
        return b

    def lowerings(self, key: str) -> list[Callable[..., Value]]:
        """The core lowering first (the rules are written for its forms), then this module's."""
        return super().lowerings(key) + ([KERNELS[key]] if key in KERNELS else [])

    def get_attr(self, node: fx.Node) -> int:
        """A tensor constant the dump names but does not show: its source line's literal if it
        assigns one (`x[mask] = 0.0`), else an input matched to the reference's."""
        users = list(node.users)
        val = users[0].meta.get("val") if users else None
        if not isinstance(val, torch.Tensor):
            raise UnsupportedOp(f"graph attribute `{node.target}` that is no tensor", "")
        dtype = str(val.dtype).removeprefix("torch.")
        literal = _assigned_literal(node.meta.get("location"))
        if literal is not None and val.dim() == 0:
            return self.graph.add("const", (), (("full", literal),), (), dtype, node.name, self.locate(node))
        self.imported.inputs.append(GraphInput(str(node.target), -1, tuple(val.shape), dtype, True))
        return self.graph.add("leaf", (), (str(node.target),), tuple(val.shape), dtype, str(node.target))


def _locate(node: fx.Node) -> Location | None:
    return node.meta.get("location")


def _assigned_literal(loc: Location | None) -> float | None:
    match = re.fullmatch(r"[\w.]+\[[^=]*\]\s*=\s*(-?\d+(\.\d*)?(e-?\d+)?)", loc.code.strip()) if loc else None
    return float(match.group(1)) if match else None


# --- normalisation kernels ------------------------------------------------------------------------
def _apex_layer_norm_fwd(lo: DumpLowerer, x, weight, bias, normalized_shape, eps) -> tuple:
    """apex fused_layer_norm_affine_fwd: (output, mean, 1/std); mean and 1/std flattened."""
    b, value = lo.builder(), lo.tensor(x)
    dims = _last_dims(lo.shape(value), normalized_shape)
    out, mean, rstd = b.layer_norm(value, lo.tensor(weight), lo.tensor(bias), dims, float(eps))
    rows = (math.prod(lo.shape(value)[: dims[0]]),)
    return out, b.view(mean, rows), b.view(rstd, rows)


def _apex_layer_norm_bwd(lo: DumpLowerer, grad, mean, invvar, x, normalized_shape, weight, bias, eps) -> tuple:
    """apex fused_layer_norm_affine_bwd: (grad input, grad weight, grad bias), the usual formulas
    dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)), dw = sum(g*xhat), db = sum(g)."""
    b, value, g = lo.builder(), lo.tensor(x), lo.tensor(grad)
    shape = lo.shape(value)
    dims = _last_dims(shape, normalized_shape)
    kept = tuple(1 if d in dims else s for d, s in enumerate(shape))
    centered = b.subtract(value, b.view(lo.tensor(mean), kept))
    rstd = b.view(lo.tensor(invvar), kept)
    xhat = b.binary("mul", centered, rstd)
    outer = tuple(range(dims[0]))
    grad_weight = b.reduce("sum", b.binary("mul", g, xhat), outer, keepdim=False)
    grad_bias = b.reduce("sum", g, outer, keepdim=False)
    gw = b.binary("mul", g, b.place(lo.tensor(weight), shape, dims))
    inner = b.subtract(gw, b.mean(gw, dims, keepdim=True))
    inner = b.subtract(inner, b.binary("mul", xhat, b.mean(b.binary("mul", gw, xhat), dims, keepdim=True)))
    return b.binary("mul", inner, rstd), grad_weight, grad_bias


def _last_dims(shape: tuple[int, ...], normalized_shape: list[int]) -> tuple[int, ...]:
    return tuple(range(len(shape) - len(normalized_shape), len(shape)))


def _rms_norm(b: GraphBuilder, x: int, weight: int, eps: float) -> int:
    return b.rms_norm(x, weight, (len(b.shape(x)) - 1,), float(eps))


# --- aten ops of training graphs and indexing -------------------------------------------------------
def _native_dropout(lo: DumpLowerer, x, p, train=None) -> tuple:
    value = lo.tensor(x)
    return value, lo.builder().full(True, lo.shape(value), "bool")


def _one_hot(b: GraphBuilder, ids: int, size: int, dtype: str) -> int:
    """one_hot(ids, size) as ids[..., None] == arange(size), in `dtype`."""
    shape = b.shape(ids)
    line = b.add("const", (), (("arange", 0, size, 1),), (size,), b.dtype(ids))
    hits = b.binary("eq", b.view(ids, shape + (1,)), b.view(line, (1,) * len(shape) + (size,)), dtype="bool")
    return b.convert(hits, dtype)


def _index(lo: DumpLowerer, x, indices) -> int:
    """x[ids] (whole rows by integer ids) as an embedding lookup."""
    b, value = lo.builder(), lo.tensor(x)
    shape = lo.shape(value)
    if len(indices) != 1 or indices[0] is None:
        raise from_fx.Declined
    ids = lo.tensor(indices[0])
    table = b.view(value, (shape[0], math.prod(shape[1:])))
    rows = b.add("embedding", (table, ids), (), lo.shape(ids) + lo.shape(table)[1:], lo.dtype(value))
    return b.view(rows, lo.shape(ids) + shape[1:])


def _index_put(lo: DumpLowerer, x, indices, values, accumulate=False) -> int:
    """x[arange(n), ids] = v as where(one_hot(ids), v, x); a boolean mask as in from_fx."""
    value = lo.tensor(x)
    shape = lo.shape(value)
    if len(indices) == 2 and not accumulate and len(shape) == 2:
        rows, ids = (lo.tensor(i) for i in indices)
        if from_fx._is_arange(lo, rows, shape[0]):
            b = lo.builder()
            hits = _one_hot(b, ids, shape[1], "bool")
            column = b.view(lo.tensor(values), (shape[0], 1)) if lo.shape(lo.tensor(values)) else lo.tensor(values)
            return b.add("where", (hits, b.broadcast_to(column, shape), value), (), shape, lo.dtype(value))
    return from_fx._LOWER["aten.index_put"](lo, x, indices, values, accumulate)


def _baddbmm(lo: DumpLowerer, bias, x, y, beta=1, alpha=1) -> int:
    b = lo.builder()
    product = from_fx._mm(lo, x, y)
    if alpha != 1:
        product = b.binary("mul", product, b.scalar(float(alpha), lo.dtype(product)))
    if beta == 0:
        return product  # the bias is not read (often torch.empty)
    scaled = b.binary("mul", lo.tensor(bias), b.scalar(float(beta), lo.dtype(product)))
    return b.binary("add", product, scaled)


def _gelu_backward(lo: DumpLowerer, grad, x, approximate="none") -> int:
    """grad * (Phi(x) + x * phi(x)) for the exact (erf) GELU."""
    if approximate != "none":
        raise from_fx.Declined
    b, value = lo.builder(), lo.tensor(x)
    dtype = lo.dtype(value)
    cdf = b.binary("mul", b.binary("add", b.unary("erf", b.binary("mul", value, b.scalar(1 / math.sqrt(2), dtype))), b.scalar(1.0, dtype)), b.scalar(0.5, dtype))
    square = b.binary("mul", value, value)
    pdf = b.binary("mul", b.unary("exp", b.binary("mul", square, b.scalar(-0.5, dtype))), b.scalar(1 / math.sqrt(2 * math.pi), dtype))
    return b.binary("mul", lo.tensor(grad), b.binary("add", cdf, b.binary("mul", value, pdf)))


def _softmax_backward(lo: DumpLowerer, grad, out, dim, dtype=None) -> int:
    """y * (g - sum(g * y)) along dim."""
    b, y, g = lo.builder(), lo.tensor(out), lo.tensor(grad)
    dim = dim % len(lo.shape(y))
    dot = b.reduce("sum", b.binary("mul", g, y), (dim,), keepdim=True)
    return b.binary("mul", y, b.subtract(g, dot))


# --- collectives ----------------------------------------------------------------------------------
def _broadcast(lo: DumpLowerer, x, src, group) -> int:
    """Rank `src`'s tensor on every rank: its chunk of an all-gather."""
    b, value = lo.builder(), lo.tensor(x)
    shape = lo.shape(value)
    rows = b.view(value, shape if shape else (1,))
    whole = gathered(lo, rows, lo.group_ranks(group))
    size = lo.shape(rows)[0]
    return b.view(slice_value(lo, whole, 0, src * size, (src + 1) * size), shape)


def _vllm_all_reduce(lo: DumpLowerer, x, group_name) -> int:
    value = lo.tensor(x)
    return lo.emit("all_reduce", (value,), ("sum", lo.group_ranks(group_name)), lo.shape(value), lo.dtype(value))


# --- auto_functionalized kernels: the new values of their mutated arguments ---------------------------
def _kernel_rms_norm(lo: DumpLowerer, result, input, weight, epsilon) -> tuple:
    return (_rms_norm(lo.builder(), lo.tensor(input), lo.tensor(weight), epsilon),)


def _kernel_fused_add_rms_norm(lo: DumpLowerer, input, residual, weight, epsilon) -> tuple:
    b = lo.builder()
    total = b.binary("add", lo.tensor(input), lo.tensor(residual))
    return _rms_norm(b, total, lo.tensor(weight), epsilon), total


def _kernel_silu_and_mul(lo: DumpLowerer, out, input) -> tuple:
    b, value = lo.builder(), lo.tensor(input)
    last = len(lo.shape(value)) - 1
    half = lo.shape(value)[last] // 2
    gate, up = b.slice(value, last, 0, half), b.slice(value, last, half, 2 * half)
    return (b.binary("mul", b.unary("silu", gate), up),)


def _kernel_rotary_embedding(lo: DumpLowerer, positions, query, key, head_size, cos_sin_cache, is_neox) -> tuple:
    """NeoX-style rotary embedding of query and key ([tokens, heads * head_size]) at positions."""
    if not is_neox:
        raise UnsupportedOp("rotary_embedding with is_neox=False (interleaved pairs)", from_fx._at(lo.locate(lo.current)))
    b = lo.builder()
    cache = lo.tensor(cos_sin_cache)
    ids = lo.tensor(positions)
    rot = lo.shape(cache)[1]
    cos_sin = b.add("embedding", (cache, ids), (), lo.shape(ids) + (rot,), lo.dtype(cache))
    tokens = lo.shape(ids)[0]
    cos = b.view(b.slice(cos_sin, 1, 0, rot // 2), (tokens, 1, rot // 2))
    sin = b.view(b.slice(cos_sin, 1, rot // 2, rot), (tokens, 1, rot // 2))
    return tuple(_rotate(b, lo.tensor(t), int(head_size), rot, cos, sin) for t in (query, key))


def _rotate(b: GraphBuilder, flat: int, head_size: int, rot: int, cos: int, sin: int) -> int:
    tokens, width = b.shape(flat)
    heads = b.view(flat, (tokens, width // head_size, head_size))
    x1, x2 = b.slice(heads, 2, 0, rot // 2), b.slice(heads, 2, rot // 2, rot)
    first = b.subtract(b.binary("mul", x1, cos), b.binary("mul", x2, sin))
    second = b.binary("add", b.binary("mul", x2, cos), b.binary("mul", x1, sin))
    parts = [first, second] + ([b.slice(heads, 2, rot, head_size)] if rot < head_size else [])
    return b.view(b.cat(parts, 2), (tokens, width))


def _kernel_unified_attention(lo: DumpLowerer, query, key, value, output, layer_name) -> tuple:
    """Causal softmax attention per head over the tokens; each kv head serves a group of query
    heads, kept as its own dim (q as [kv heads, group, tokens, d]) so a rank's kv heads stay
    regions of the reference's."""
    b = lo.builder()
    q, k, v = (lo.tensor(t) for t in (query, key, value))
    tokens, heads, size = lo.shape(q)
    kv_heads = lo.shape(k)[1]
    group = heads // kv_heads
    q4 = b.permute(b.view(q, (tokens, kv_heads, group, size)), (1, 2, 0, 3))
    k4 = b.broadcast_to(b.view(b.permute(k, (1, 2, 0)), (kv_heads, 1, size, tokens)), (kv_heads, group, size, tokens))
    scores = b.binary("mul", b.matmul(q4, k4), b.scalar(1 / math.sqrt(size), lo.dtype(q)))
    line = b.add("const", (), (("arange", 0, tokens, 1),), (tokens,), "int64")
    causal = b.binary("ge", b.view(line, (tokens, 1)), b.view(line, (1, tokens)), dtype="bool")
    blocked = b.full(-math.inf, b.shape(scores), lo.dtype(q))
    masked = b.add("where", (b.broadcast_to(causal, b.shape(scores)), scores, blocked), (), b.shape(scores), lo.dtype(q))
    probs = b.unary("softmax", masked, (3,))
    v4 = b.broadcast_to(b.view(b.permute(v, (1, 0, 2)), (kv_heads, 1, tokens, size)), (kv_heads, group, tokens, size))
    context = b.permute(b.matmul(probs, v4), (2, 0, 1, 3))
    return (b.view(context, (tokens, heads, size)),)


_MUTATING: dict[str, Callable[..., tuple]] = {
    "_C.rms_norm": _kernel_rms_norm,
    "_C.fused_add_rms_norm": _kernel_fused_add_rms_norm,
    "_C.silu_and_mul": _kernel_silu_and_mul,
    "_C.rotary_embedding": _kernel_rotary_embedding,
    "vllm.unified_attention_with_output": _kernel_unified_attention,
}


def _auto_functionalized(lo: DumpLowerer, op, **kwargs) -> tuple:
    """(kernel result, new value of each mutated argument): these kernels return nothing."""
    kernel = _MUTATING.get(from_fx._aten_key(op))
    if kernel is None:
        raise UnsupportedOp(f"auto_functionalized {op}", from_fx._at(lo.locate(lo.current)))
    return (None, *kernel(lo, **kwargs))


def _auto_functionalized_v2(lo: DumpLowerer, op, **kwargs) -> tuple:
    """Only logging kernels that leave their tensors unchanged; `s` names the logged parameter."""
    if from_fx._aten_key(op) != "tg.inplace_log_tensor":
        raise UnsupportedOp(f"auto_functionalized_v2 {op}", from_fx._at(lo.locate(lo.current)))
    bases = [lo.tensor(t) for t in kwargs.get("_all_bases", [])]
    for base in kwargs.get("_all_bases", []):
        source = _source_input(base)
        if source is not None and "s" in kwargs:
            lo.imported.labels[source] = kwargs["s"]
    return (None, *bases)


def _source_input(node: Any) -> str | None:
    """The graph input a chain of single-input copies (clone, detach) starts from."""
    while isinstance(node, fx.Node) and node.op == "call_function" and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node.meta.get("dump_name") if isinstance(node, fx.Node) and node.op == "placeholder" else None


KERNELS: dict[str, Callable[..., Value]] = {
    "apex.fused_layer_norm_affine_fwd": _apex_layer_norm_fwd,
    "apex.fused_layer_norm_affine_bwd": _apex_layer_norm_bwd,
    "aten.native_dropout": _native_dropout,
    "aten.index": _index,
    "aten.index_put": _index_put,
    "aten.baddbmm": _baddbmm,
    "aten.gelu_backward": _gelu_backward,
    "aten._softmax_backward_data": _softmax_backward,
    "aten.new_empty_strided": from_fx._empty,
    "_c10d_functional.broadcast": _broadcast,
    "vllm.all_reduce": _vllm_all_reduce,
    "tg.log_tensor": lambda lo, x, name: lo.tensor(x),
    "higher_order.auto_functionalized": _auto_functionalized,
    "higher_order.auto_functionalized_v2": _auto_functionalized_v2,
}
