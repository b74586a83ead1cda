"""What to do when tracing stops at a known limit of tracing without values: the model reads a
tensor's value, or makes a tensor whose shape depends on values. Keyed by torch's exception types."""

from __future__ import annotations

_READS_A_VALUE = (
    "the model reads a tensor's value here (`.item()`, `if tensor ...:`, `bool()`, `.tolist()`), but shardproof "
    "traces shapes, not values, so a value cannot steer the program. Keep it a tensor (e.g. `torch.where(cond, a, b)` "
    "for an `if`, a tensor instead of `.item()`), or compute it from Python numbers and shapes. Split sizes read "
    "off the routing are traced only as counts of keys sorted by a stable argsort (torchtitan's all_to_all "
    "dispatch); otherwise send fixed-size buffers with the gates as data (zero where a token is not routed), as "
    "`examples/moe_ep.py` does, proven for every routing"
)
_SHAPE_FROM_VALUES = (
    "the size of a tensor made here depends on tensor values (`nonzero`, a boolean mask as an index, `unique`); "
    "use a fixed-shape form instead (multiply by the mask, `torch.where`)"
)
HINTS = {
    "DataDependentOutputException": _READS_A_VALUE,
    "GuardOnDataDependentSymNode": _READS_A_VALUE,
    "DynamicOutputShapeException": _SHAPE_FROM_VALUES,
}


def reads_a_value(err: BaseException | None) -> bool:
    """The trace stopped where the model reads a tensor's value (this error or one of its causes)."""
    while err is not None:
        if HINTS.get(type(err).__name__) is _READS_A_VALUE:
            return True
        err = err.__cause__ or err.__context__
    return False


def hint(err: BaseException) -> str:
    """Advice on one line after the error's own ("" when there is none), from the error or its causes."""
    while err is not None:
        advice = HINTS.get(type(err).__name__)
        if advice is not None:
            return f"\n  what to do: {advice}"
        err = err.__cause__ or err.__context__
    return ""
