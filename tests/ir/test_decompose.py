"""Our own decompositions (`ir/decompose.OWN`) against torch's kernels and a float64 loop."""

from __future__ import annotations

import pytest
import torch

from shardproof.ir.decompose import OWN, decomposition_of

GROUPED_MM = OWN[torch.ops.aten._grouped_mm.default]
OFFSETS = [(2, 2, 7, 16), (0, 5, 9, 16), (3, 6, 10, 12)]  # an empty group; a first empty group; rows past the last end


def _loop(a: torch.Tensor, b: torch.Tensor, offs: tuple[int, ...]) -> torch.Tensor:
    """The meaning of `_grouped_mm`, group by group, in float64 (rows past the last end: zero)."""
    a, b = a.double(), b.double()
    starts = (0, *offs[:-1])
    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float64)
        for e, (lo, hi) in enumerate(zip(starts, offs)):
            out[lo:hi] = a[lo:hi] @ b[e]
    elif a.dim() == 3:
        out = torch.zeros(a.shape[1], b.shape[-1], dtype=torch.float64)
        for e, (lo, hi) in enumerate(zip(starts, offs)):
            out[:, lo:hi] = a[e] @ b[:, lo:hi]
    else:
        out = torch.stack([a[:, lo:hi] @ b[lo:hi] for lo, hi in zip(starts, offs)])
    return out


def _operands(form: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = {"rows": ((16, 8), (4, 8, 8)), "columns": ((4, 16, 8), (8, 16)), "contracted": ((8, 16), (16, 8))}[form]
    return tuple(torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes)


@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("form", ["rows", "columns", "contracted"])
def test_grouped_mm_is_one_masked_product_per_group(form: str, offsets: tuple[int, ...]) -> None:
    a, b = _operands(form, torch.Generator().manual_seed(sum(offsets)))
    offs = torch.tensor(offsets, dtype=torch.int32)
    ours = GROUPED_MM(a, b, offs).double()
    expected = _loop(a, b, offsets)
    torch.testing.assert_close(ours, expected, rtol=2e-2, atol=2e-2)
    theirs = torch._grouped_mm(a, b, offs=offs).double()
    written = {"rows": (slice(0, offsets[-1]),), "columns": (slice(None), slice(0, offsets[-1])), "contracted": ()}[form]
    torch.testing.assert_close(ours[written], theirs[written])  # torch leaves the rest unwritten


def test_grouped_mm_decomposes_in_float32_on_meta_tensors() -> None:
    """The reason for the table: torch's meta kernel takes bf16 only on the CPU; ours any dtype."""
    a, b = torch.empty(16, 8, device="meta"), torch.empty(4, 8, 8, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    assert decomposition_of(torch.ops.aten._grouped_mm.default) is GROUPED_MM
    assert GROUPED_MM(a, b, offs).shape == (16, 8)


def test_a_bias_keeps_grouped_mm_whole() -> None:
    a, b = _operands("rows", torch.Generator().manual_seed(0))
    assert GROUPED_MM(a, b, torch.tensor((4, 8, 12, 16), dtype=torch.int32), bias=torch.zeros(4, 8)) is NotImplemented
