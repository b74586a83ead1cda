"""What the values of terms are: every float dtype is one real dtype, and a float constant stands for
the real number the program meant. Shared by the constructors and the rules alike.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any


FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}
PARTS = ("lin", "piece", "max_piece", "arg_piece", "top_piece")  # terms that layout ops map into: they move elements, so they
# commute with summing ranks' values and with taking their max
REAL = "float64"  # the dtype of every float term


def real(dtype: str) -> str:
    """The dtype a term of IR dtype `dtype` has."""
    return REAL if dtype in FLOAT_DTYPES else dtype


SIMPLE_DENOMINATOR = 10**6
ROUNDING_ULPS = 8  # how far Python's arithmetic on a few constants may have rounded them


def intended(value: float) -> float | Fraction:
    """The real number a float constant stands for: a fraction with a small denominator within a
    few units of rounding of it, if there is one. Python rounds `0.1 * V / (V - 1)` and `1.0 - s`
    step by step, so over the reals the coefficients of a label-smoothed loss no longer add up to 1,
    while the program meant 8/75 and 67/75. A float exact with a small denominator stays as it is."""
    if not math.isfinite(value):
        return value
    exact = Fraction(value)
    if exact.denominator <= SIMPLE_DENOMINATOR:
        return value
    simple = exact.limit_denominator(SIMPLE_DENOMINATOR)
    return simple if abs(simple - exact) <= ROUNDING_ULPS * Fraction(math.ulp(value)) else value


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float, Fraction)) and not isinstance(value, bool) and math.isfinite(value)
