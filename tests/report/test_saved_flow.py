"""saved_flow: from a line of an autograd Function's backward to the forward's line that computed
a number it reads from `ctx` (through a name bound from `ctx`, the forward's store and the name
stored there); none for a line of no backward, a value the forward only copies from a parameter,
or a tensor the backward reads from elsewhere."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from shardproof.report.saved_flow import saved_origin

PROGRAM = """
    import torch

    class Smoothed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, alpha, n):
            size = x.shape[-1] * n  # SIZE
            smoothing = alpha * size / (size - 1)  # COMPUTED
            ctx.smoothing, ctx.size, ctx.alpha = smoothing, size, alpha
            ctx.half = smoothing / 2  # STORED
            return x * smoothing  # FORWARD

        @staticmethod
        def backward(ctx, grad):
            smoothing, alpha, half = ctx.smoothing, ctx.alpha, ctx.half
            out = grad.clone()
            out -= smoothing / 16  # USE
            out += alpha  # PARAMETER
            out *= half  # HALF
            return out, None, None
"""


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if f"# {marker}" in text)


@pytest.mark.parametrize("use, origin", [("USE", "COMPUTED"), ("HALF", "STORED")])
def test_a_saved_number_is_traced_to_the_forward_line_that_computed_it(tmp_path: Path, use: str, origin: str) -> None:
    source = textwrap.dedent(PROGRAM)
    path = tmp_path / "smoothed.py"
    path.write_text(source)
    found = saved_origin(str(path), _line(source, use))
    assert found is not None and (found.line, found.used) == (_line(source, origin), _line(source, use))
    assert f"# {origin}" in found.code


@pytest.mark.parametrize("use", ["PARAMETER", "FORWARD"])
def test_no_origin_for_a_copied_parameter_or_a_line_of_no_backward(tmp_path: Path, use: str) -> None:
    """Must not match: `alpha` is stored as the forward got it; the forward's own line is no backward's."""
    source = textwrap.dedent(PROGRAM)
    path = tmp_path / "smoothed.py"
    path.write_text(source)
    assert saved_origin(str(path), _line(source, use)) is None
