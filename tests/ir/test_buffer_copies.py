"""The copies FSDP2 makes into and out of its flat collective buffers lower to their values:
`_foreach_copy_` into views of one buffer, `split_with_sizes_copy(out=...)`, `_chunk_cat(out=...)`,
and `as_strided` views that read a run of a contiguous buffer; each checked against torch."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardproof.ir.from_fx import Lowerer
from shardproof.ir.run import run_graph


def _traced(fn, *args: torch.Tensor):
    """As capture traces: on fake tensors, whose views keep their memory offsets."""
    return make_fx(fn, tracing_mode="fake")(*args)


def _lowered(fn, *args: torch.Tensor) -> list[torch.Tensor]:
    program = _traced(fn, *args)
    names = [f"x{i}" for i in range(len(args))]
    graph = Lowerer(program, names, lambda node: None, [], lambda group: (), None).run()
    return run_graph(graph, dict(zip(names, args)))


def _copy_in_and_out(w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """All-gather copy-in and copy-out as FSDP2 does them, for a world of 2 at rank 1."""
    flat = torch.empty(2 * (w.numel() + b.numel()), dtype=w.dtype)
    mine = flat.narrow(0, w.numel() + b.numel(), w.numel() + b.numel())
    torch._foreach_copy_(list(torch.split(mine, [w.numel(), b.numel()])), [w.reshape(-1), b])
    flat[: w.numel() + b.numel()] = 0.5  # the other rank's part, as a collective would fill it
    rows = flat.view(2, -1)
    outs = [torch.empty(2, w.numel(), dtype=w.dtype), torch.empty(2, b.numel(), dtype=w.dtype)]
    torch.split_with_sizes_copy(rows, [w.numel(), b.numel()], dim=1, out=outs)
    weight = torch.as_strided(outs[0], (2 * w.shape[0], w.shape[1]), (w.shape[1], 1), 0)
    chunked = torch.empty(2, (w.numel() + b.numel()) // 2 * 2, dtype=w.dtype)
    torch._chunk_cat([weight, outs[1].view(-1)], 0, 2, out=chunked)
    return weight * 2, outs[1] + 1, chunked


def test_copies_into_and_out_of_a_flat_buffer_lower_to_their_values() -> None:
    w, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    for got, want in zip(_lowered(_copy_in_and_out, w, b), _copy_in_and_out(w, b)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("size, stride, offset, lowered", [
    ((3, 4), (4, 1), 0, True),  # the buffer's head, row-major
    ((2, 4), (4, 1), 4, True),  # a run further in
    ((4, 3), (1, 4), 0, False),  # transposed: an open op
])
def test_as_strided_reading_a_run_is_a_slice(size, stride, offset, lowered) -> None:
    x = torch.randn(12, dtype=torch.float64)

    def view(t: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(t * 1, size, stride, offset)

    program = _traced(view, x)
    graph = Lowerer(program, ["x"], lambda node: None, [], lambda group: (), None).run()
    assert any(n.op.startswith("aten.as_strided") for n in graph.nodes) != lowered
    if lowered:
        torch.testing.assert_close(run_graph(graph, {"x": x})[0], view(x))


@pytest.mark.parametrize("offset", [None, 3])
def test_as_strided_of_a_transposed_view_reads_the_memory_under_it(offset) -> None:
    """A kernel reading its argument from the data pointer: dense strides over a transposed view
    read the contiguous tensor it views in row-major order, not the view's elements in order."""
    x = torch.randn(3, 4, dtype=torch.float64)

    def read(t: torch.Tensor) -> torch.Tensor:
        view = (t * 1).transpose(0, 1)
        return view.as_strided((2, 3) if offset else (4, 3), (3, 1), offset) + 0

    program = _traced(read, x)
    graph = Lowerer(program, ["x"], lambda node: None, [], lambda group: (), None).run()
    assert not any(n.op.startswith("aten.as_strided") for n in graph.nodes)
    torch.testing.assert_close(run_graph(graph, {"x": x})[0], read(x))
    assert not torch.equal(read(x), (x * 1).transpose(0, 1)[: read(x).shape[0]])
