"""Emit IR with explicit broadcasting: the helpers importers use to spell a source op in IR ops.

A frontend op often means several IR ops (an RMS norm is a mean of squares, an rsqrt and two
products; an HLO `dot` is permutes, reshapes and a matmul). `GraphBuilder` writes them into a
Graph with the name and source location of the op being lowered, so every emitted node points at
the user's line.
"""

from __future__ import annotations

import math

import torch

from shardproof.ir.graph import Graph, Location


class GraphBuilder:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.name = "op"
        self.loc: Location | None = None
        self._scalars: dict[tuple, int] = {}

    def at(self, name: str, loc: Location | None) -> None:
        """Name and locate the nodes emitted from now on (the source op being lowered)."""
        self.name, self.loc = name, loc

    def add(self, op: str, inputs: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], dtype: str) -> int:
        return self.graph.add(op, inputs, attrs, tuple(shape), dtype, self.name, self.loc)

    def shape(self, value: int) -> tuple[int, ...]:
        return self.graph[value].shape

    def dtype(self, value: int) -> str:
        return self.graph[value].dtype

    # --- constants ------------------------------------------------------------------------------
    def scalar(self, value: float | int | bool, dtype: str) -> int:
        key = (value, dtype)
        if key not in self._scalars:
            self._scalars[key] = self.graph.add("const", (), (("full", value),), (), dtype, f"scalar_{value}")
        return self._scalars[key]

    def full(self, value: float | int | bool, shape: tuple[int, ...], dtype: str) -> int:
        return self.add("const", (), (("full", value),), shape, dtype)

    # --- layout ---------------------------------------------------------------------------------
    def view(self, value: int, shape: tuple[int, ...]) -> int:
        if self.shape(value) == tuple(shape):
            return value
        return self.add("view", (value,), (tuple(shape),), shape, self.dtype(value))

    def permute(self, value: int, perm: tuple[int, ...]) -> int:
        perm = tuple(perm)
        if perm == tuple(range(len(perm))):
            return value
        shape = tuple(self.shape(value)[p] for p in perm)
        return self.add("permute", (value,), (perm,), shape, self.dtype(value))

    def slice(self, value: int, dim: int, start: int, end: int) -> int:
        shape = list(self.shape(value))
        if (start, end) == (0, shape[dim]):
            return value
        shape[dim] = end - start
        return self.add("slice", (value,), (dim, start, end), tuple(shape), self.dtype(value))

    def cat(self, values: list[int], dim: int) -> int:
        if len(values) == 1:
            return values[0]
        shape = list(self.shape(values[0]))
        shape[dim] = sum(self.shape(v)[dim] for v in values)
        return self.add("cat", tuple(values), (dim,), tuple(shape), self.dtype(values[0]))

    def place(self, value: int, shape: tuple[int, ...], dims: tuple[int, ...]) -> int:
        """Operand dim i becomes dim dims[i] of `shape`; the other dims repeat it (HLO broadcast)."""
        order = sorted(range(len(dims)), key=lambda i: dims[i])
        value = self.permute(value, tuple(order))
        placed = tuple(shape[d] if d in dims else 1 for d in range(len(shape)))
        return self.broadcast_to(self.view(value, placed), shape)

    def broadcast_to(self, value: int, shape: tuple[int, ...]) -> int:
        """numpy broadcasting made explicit: leading 1-dims by view, then expand."""
        have, shape = self.shape(value), tuple(shape)
        if have == shape:
            return value
        if len(have) < len(shape):
            value = self.view(value, (1,) * (len(shape) - len(have)) + have)
        if self.shape(value) == shape:
            return value
        return self.add("expand", (value,), (shape,), shape, self.dtype(value))

    def convert(self, value: int, dtype: str) -> int:
        if self.dtype(value) == dtype:
            return value
        return self.add("convert", (value,), (dtype,), self.shape(value), dtype)

    # --- arithmetic -----------------------------------------------------------------------------
    def unary(self, op: str, value: int, attrs: tuple = ()) -> int:
        return self.add(op, (value,), attrs, self.shape(value), self.dtype(value))

    def binary(self, op: str, a: int, b: int, dtype: str | None = None) -> int:
        shape = tuple(torch.broadcast_shapes(self.shape(a), self.shape(b)))
        operands = (self.broadcast_to(a, shape), self.broadcast_to(b, shape))
        return self.add(op, operands, (), shape, dtype or self.dtype(a))

    def subtract(self, a: int, b: int) -> int:
        return self.binary("add", a, self.unary("neg", b))

    def reduce(self, op: str, value: int, dims: tuple[int, ...], keepdim: bool) -> int:
        dims = tuple(sorted(dims))
        shape = tuple(1 if d in dims else s for d, s in enumerate(self.shape(value)) if keepdim or d not in dims)
        return self.add(op, (value,), (dims, keepdim), shape, self.dtype(value))

    def mean(self, value: int, dims: tuple[int, ...], keepdim: bool) -> int:
        total = self.reduce("sum", value, dims, keepdim)
        count = math.prod(self.shape(value)[d] for d in dims)
        return self.binary("mul", total, self.scalar(1.0 / max(1, count), self.dtype(total)))

    def matmul(self, a: int, b: int) -> int:
        sa, sb = self.shape(a), self.shape(b)
        batch = tuple(torch.broadcast_shapes(sa[:-2], sb[:-2])) if len(sa) > 2 or len(sb) > 2 else ()
        shape = batch + sa[-2:-1] + sb[-1:]
        return self.add("matmul", (a, b), (), shape, self.dtype(a))

    # --- normalisations, as their arithmetic so the rules see through them ------------------------
    def rms_norm(self, x: int, weight: int | None, dims: tuple[int, ...], eps: float) -> int:
        """x * rsqrt(mean(x^2 over dims) + eps) * weight (weight laid along `dims`)."""
        variance = self.mean(self.binary("mul", x, x), dims, keepdim=True)
        rstd = self.unary("rsqrt", self.binary("add", variance, self.scalar(float(eps), self.dtype(variance))))
        out = self.binary("mul", x, rstd)
        return out if weight is None else self.binary("mul", out, self.place(weight, self.shape(out), dims))

    def layer_norm(
        self, x: int, weight: int | None, bias: int | None, dims: tuple[int, ...], eps: float
    ) -> tuple[int, int, int]:
        """(normalised * weight + bias, mean, rstd): mean and rstd keep the reduced dims."""
        mean = self.mean(x, dims, keepdim=True)
        centered = self.subtract(x, mean)
        variance = self.mean(self.binary("mul", centered, centered), dims, keepdim=True)
        rstd = self.unary("rsqrt", self.binary("add", variance, self.scalar(float(eps), self.dtype(variance))))
        out = self.binary("mul", centered, rstd)
        for op, param in (("mul", weight), ("add", bias)):
            if param is not None:
                out = self.binary(op, out, self.place(param, self.shape(out), dims))
        return out, mean, rstd
