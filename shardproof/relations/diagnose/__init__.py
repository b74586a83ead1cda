"""Where and why a rank parts ways with the reference, once the outputs were not proven equal.

The first op of a rank whose value is not built from reference values by layout and linear structure
alone is where the two programs diverge. What the divergence looks like says what kind of fault it
is: a partial sum consumed by a nonlinear op (missing reduction), a sum over ranks whose pieces
overlap or leave gaps, or whose contractions pair operands one rank cut at different offsets
(overlapping shards), the right terms with the wrong coefficients (double counting, wrong scale), or
an operand that is the wrong region of a reference tensor (wrong layout). Anything else is
`unknown`: a rule may be missing, which is not a bug.
"""

from __future__ import annotations

from shardproof.relations.diagnose.agreement import grounded
from shardproof.relations.diagnose.diagnoser import Diagnoser
from shardproof.relations.diagnose.finding import Finding

__all__ = ["Diagnoser", "Finding", "grounded"]
