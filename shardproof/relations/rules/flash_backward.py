"""The laws by which flash and ring attention's backward recomputes the softmax backward of the
reference (P = softmax(S), dS = P * (dP - rowsum(dP * P)) with dP = dO @ V^T) from what the forward
kept, the output O = P @ V and the log-sum-exp L of the scores:
- exp(S_i - L) = P_i: the probabilities of a block of keys S_i (a region of S along the keys, or
  all of it) from the log-sum-exp of the whole row;
- rowsum(dO * (P @ V)) = rowsum((dO @ V^T) * P): the row's inner product moved across the product;
- masked_fill's backward, where(mask, 0, G), is G where G is a multiple of probabilities whose
  scores the same mask set to -inf (they vanish there; assumed, as for the softmax itself, that
  each row has a key the mask leaves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.relations.rules import masked_keys
from shardproof.relations.rules.online_softmax import _as_lse, attention_of

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def probabilities(r: Rules, exponent: int, shape: tuple[int, ...], dtype: str) -> int | None:
    """exp(S_i - L) as softmax(S)[..., i], L = LSE(S) broadcast along the keys."""
    term = r.u[exponent]
    if term.op != "lin":
        return None
    lses = [(i, _as_lse(r, r.u[a].args[0])) for i, (a, c) in enumerate(zip(term.args, term.attrs[0]))
            if c == -1 and r.op(a) == "bcast"]
    lses = [(i, found) for i, found in lses if found is not None]
    if len(lses) != 1:
        return None
    index, (scores, dim) = lses[0]
    broadcast = r.u[term.args[index]]
    if len(broadcast.attrs[0]) != len(shape) - 1 or dim in broadcast.attrs[0] or dim != len(shape) - 1:
        return None  # (the row's log-sum-exp broadcast along the last dim, the keys)
    block = r.lin([(a, c) for i, (a, c) in enumerate(zip(term.args, term.attrs[0])) if i != index])
    (root_b, box_b), (root_s, box_s) = masked_keys.on_masked_root(r, [block, scores], [r.as_region(block), r.as_region(scores)])
    if block != scores and (root_b != root_s or any(
        box_b[d] != box_s[d] if d != dim else not (box_s[d][0] <= box_b[d][0] and box_b[d][1] <= box_s[d][1])
        for d in range(len(shape))
    )):
        return None
    probs = r.build("softmax", (scores,), (dim,), r.shape(scores), dtype)
    lo = box_s[dim][0]
    keys = tuple((box_b[d][0] - lo, box_b[d][1] - lo) if d == dim else (0, n) for d, n in enumerate(shape))
    return r.slice(probs, keys)


def row_dot(r: Rules, x: int, shape: tuple[int, ...], dtype: str) -> int | None:
    """sum(G * (P @ V), -1) as sum((G @ V^T) * P, -1), P = softmax(S)."""
    term = r.u[x]
    if term.op != "mul" or len(term.args) != 2:
        return None
    for grad, out in (term.args, term.args[::-1]):
        found = attention_of(r, out)
        if found is None or r.op(r.u[out].args[0]) != "softmax" or r.shape(grad) != r.shape(out):
            continue
        probs, values = r.u[out].args
        n = len(r.shape(values))
        values_t = r.permute(values, tuple(range(n - 2)) + (n - 1, n - 2))
        grad_probs = r.build("matmul", (grad, values_t), (), r.shape(probs), dtype)
        product = r.build("mul", (grad_probs, probs), (), r.shape(probs), dtype)
        return r.build("sum", (product,), ((len(r.shape(probs)) - 1,), False), shape, dtype)
    return None


def vanishes(r: Rules, t: int, mask: int) -> bool:
    """t is zero wherever `mask` is True: a multiple of softmax(where(mask, -inf, S))."""
    term = r.u[t]
    if term.op == "mul":
        return any(vanishes(r, a, mask) for a in term.args)
    if term.op == "lin":
        return all(vanishes(r, a, mask) for a in term.args)
    if term.op == "softmax":
        scores = r.u[term.args[0]]
        if scores.op == "where" and scores.args[0] == mask and r.full_value(scores.args[1]) == float("-inf"):
            r.assumptions.add(masked_keys.VISIBLE_ROWS)
            return True
    return False

