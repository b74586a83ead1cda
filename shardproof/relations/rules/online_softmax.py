"""Log-sum-exp and the online-softmax merge law, by which ring and flash attention put together the
attention over key blocks computed apart.

`logsumexp(x, d)` = log(sum(exp(x), d)) is one term however it is spelled: torch decomposes
`torch.logsumexp` into log(sum(exp(x - c))) + c, c the max along d guarded against infinities,
and any c constant along d cancels over the reals. (Shifted by the plain row max it is log-softmax's
spelling, vocab-parallel cross entropy's, which keeps its own normal form: `reductions.py`.)
Over key blocks s_i joined along d, S = cat_i s_i:
- LSE(stack_i LSE(s_i, d)) = LSE(S, d): the log-sum-exp of the blocks' log-sum-exps (a ring's
  running `logaddexp`, or `logsumexp` of the stacked ones);
- sum_i exp(LSE(s_i) - LSE(S)) * (softmax(s_i) @ v_i) = softmax(S) @ cat_i v_i: the merge of the
  blocks' attentions by log-sum-exp is the attention over the keys of all of them.
Softmax along d and a product contracting d do not depend on the order of the keys, so blocks that
are regions of one tensor are put in key order: a ring that merges its own block first meets the
reference. Assumed (and said so in the report): every row of every block has a finite score, as
when a ring skips the blocks a causal mask hides entirely.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

from shardproof.relations.rules import masked_keys

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules

LSE = "logsumexp"
FINITE_BLOCKS = ("attention merged by log-sum-exp: equal to the reference's where every key block's log-sum-exp is "
                 "finite (no row of a merged block masked entirely)")


def log_of_sum_exp(r: Rules, summed: int, shape: tuple[int, ...], dtype: str) -> int | None:
    """log(sum(exp(x - c), d)) as LSE(x, d) - c, for c the terms of the exponent constant along d."""
    found = _exponent(r, summed)
    if found is None:
        return None
    exponent, dim = r.u[found[0]], found[1]
    pairs = list(zip(exponent.args, exponent.attrs[0])) if exponent.op == "lin" else [(found[0], Fraction(1))]
    rows = [(_row(r, t, dim, shape), c) for t, c in pairs]
    if any(row is not None and r.op(row) == "amax" for row, _ in rows):
        return None  # shifted by the row max: log-softmax's spelling (`reductions.log_softmax`), met op for op
    varying = [(t, c) for (t, c), (row, _) in zip(pairs, rows) if row is None]
    if not varying:
        return None
    x = r.lin(varying)
    shifts = [(row, c) for row, c in rows if row is not None]
    return r.lin([(r.build(LSE, (x,), (dim,), shape, dtype), Fraction(1)), *shifts])


def _exponent(r: Rules, summed: int) -> tuple[int, int] | None:
    """(e, d) with `summed` = sum(exp(e), d): also a piece of such a sum (a block of keys that is a
    region of a larger row, summed as a share of the row's sum) and a region of the exp."""
    term = r.u[summed]
    window = None
    if term.op == "piece" and term.attrs[0][0] == "sum":
        window = term.attrs[1:3]
        term = r.u[term.args[0]]
    if term.op != "sum" or len(term.attrs[0]) != 1 or term.attrs[1]:
        return None
    (dim,) = term.attrs[0]
    power, box = r.as_region(term.args[0])
    if r.op(power) != "exp":
        return None
    if window is not None:
        box = tuple(window if d == dim else b for d, b in enumerate(box))
    return r.slice(r.u[power].args[0], box), dim


def _row(r: Rules, t: int, dim: int, shape: tuple[int, ...]) -> int | None:
    """`t` with `dim` dropped, if `t` is the same all along `dim` (a broadcast or a constant)."""
    if r.full_value(t) is not None:
        return r.literal("full", (), (r.full_value(t),), shape, r.u[t].dtype)
    term = r.u[t]
    if term.op != "bcast" or dim in term.attrs[0]:
        return None
    return r.bcast(term.args[0], shape, tuple(d - (d > dim) for d in term.attrs[0]))


def logsumexp(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """The rule of LSE terms: of LSEs stacked along the reduced dim, of blocks in key order, of a
    region along kept dims (a slice of the whole's)."""
    (dim,) = attrs
    x = args[0]
    term = r.u[x]
    if term.op == "cat" and term.attrs[0] == dim:
        inner = [_lse_of(r, p, dim) for p in term.args]
        if None not in inner and len({e for _, e in inner}) == 1:
            e = inner[0][1]
            return r.build(LSE, (in_key_order(r, [s for s, _ in inner], e),), (e,), shape, dtype)
        ordered = in_key_order(r, list(term.args), dim)
        if ordered != x:
            return r.build(LSE, (ordered,), attrs, shape, dtype)
    root, box = r.as_region(x)
    if root != x and box[dim] == (0, r.shape(root)[dim]):
        whole = tuple(s for d, s in enumerate(r.shape(root)) if d != dim)
        return r.slice(r.build(LSE, (root,), attrs, whole, dtype), tuple(b for d, b in enumerate(box) if d != dim))
    return r.literal(LSE, (x,), attrs, shape, dtype)


def _lse_of(r: Rules, t: int, dim: int) -> tuple[int, int] | None:
    """(scores, their reduced dim) of a part of a stack of LSEs: LSE(s, e) with a size-1 `dim` added
    (a view, or in normal form a broadcast)."""
    term = r.u[t]
    if term.shape[dim] != 1 or not (term.op == "view" or term.op == "bcast" and len(term.attrs[0]) == len(term.shape) - 1):
        return None  # (a size-1 dim added beside another one, as a batch of one, may be either)
    if r.shape(term.args[0]) != term.shape[:dim] + term.shape[dim + 1 :]:
        return None
    return _as_lse(r, term.args[0])


def in_key_order(r: Rules, parts: list[int], dim: int) -> int:
    """The blocks joined along `dim` in key order (`_key_ordered`)."""
    return r.cat(_key_ordered(r, parts, dim), dim)


def _key_ordered(r: Rules, parts: list[int], dim: int) -> list[int]:
    """The blocks (blocks joined earlier taken apart) in key order along `dim` where they are
    regions of one tensor."""
    parts = [a for p in parts for a in (r.u[p].args if r.op(p) == "cat" and r.u[p].attrs[0] == dim else (p,))]
    regions = masked_keys.on_masked_root(r, parts, [r.as_region(p) for p in parts])
    if len({root for root, _ in regions}) != 1:
        return parts
    return [p for _, p in sorted(zip((box[dim] for _, box in regions), parts))]


def partial_result_of(r: Rules, t: int) -> list[int] | None:
    """The values `t` is computed from if it is a partial result of an online softmax: a block's
    log-sum-exp (or a region of one), its attention, or a merge weight exp(sum of log-sum-exps)."""
    if r.op(t) not in (LSE, "slice", "exp", "matmul") and t not in r.attentions:
        return None  # (seen first: this runs for every term a diagnosis or a call boundary reads)
    lse = _as_lse(r, t)
    if lse is not None:
        return [lse[0]]
    attention = attention_of(r, t)
    if attention is not None:
        return list(attention)
    power, box = r.as_region(t)
    exponent = r.u[r.u[power].args[0]] if r.op(power) == "exp" else None
    if exponent is None or exponent.op != "lin":
        return None
    scores = [_as_lse(r, a) for a in exponent.args]
    return None if None in scores else [s for s, _ in scores]


def attention_of(r: Rules, t: int) -> tuple[int, int] | None:
    """(scores S, values V) with t = softmax(S) @ V over the last dim of S."""
    if t in r.attentions:
        return r.attentions[t]
    term = r.u[t]
    if term.op != "matmul":
        return None
    probs = r.u[term.args[0]]
    if probs.op != "softmax" or probs.attrs[0] % len(probs.shape) != len(probs.shape) - 1:
        return None
    return probs.args[0], term.args[1]


def merged(r: Rules, items: list[tuple[int, Fraction]]) -> int | None:
    """sum_i exp(LSE(s_i) - LSE(S)) * A_i, A_i = softmax(s_i) @ v_i and S the blocks s_i joined
    (in any order), is softmax(S) @ V, V the v_i joined alike."""
    if len(items) < 2 or any(c != 1 for _, c in items):
        return None
    blocks, whole = {}, None
    for t, _ in items:
        found = weighted_block(r, t)
        if found is None:
            return None
        scores, values, total = found
        if whole not in (None, total) or masked_keys.hidden(r, *r.as_region(scores)):
            return None  # (a block the mask hides entirely: softmax over no key, NaN, not nothing)
        whole = total
        blocks.update(_apart(r, scores, values))
    joined, dim = whole
    parts = _key_ordered(r, list(blocks), dim)
    if dim != len(r.shape(joined)) - 1 or r.cat(parts, dim) != joined:
        return None
    values = r.cat([blocks[p] for p in parts], len(r.shape(blocks[parts[0]])) - 2)
    probs = r.build("softmax", (joined,), (dim,), r.shape(joined), r.u[joined].dtype)
    shape = r.shape(joined)[:-1] + r.shape(values)[-1:]
    result = r.build("matmul", (probs, values), (), shape, r.u[items[0][0]].dtype)
    r.attentions[result] = (joined, values)
    r.assumptions.add(FINITE_BLOCKS)
    return result


def _apart(r: Rules, scores: int, values: int) -> dict[int, int]:
    """A block's scores -> values, a block merged earlier taken apart into the blocks it joined."""
    term = r.u[scores]
    if term.op != "cat" or term.attrs[0] != len(term.shape) - 1:
        return {scores: values}
    parts, lo = {}, 0
    for p in term.args:
        hi = lo + r.shape(p)[-1]
        rows = tuple((lo, hi) if d == len(r.shape(values)) - 2 else (0, n) for d, n in enumerate(r.shape(values)))
        parts[p] = r.slice(values, rows)
        lo = hi
    return parts


def weighted_block(r: Rules, t: int) -> tuple[int, int, tuple[int, int]] | None:
    """(s_i, v_i, (S, d)) of exp(LSE(s_i, d) - LSE(S, d)), broadcast over the last dim, times
    softmax(s_i) @ v_i."""
    term = r.u[t]
    if term.op != "mul":
        return None
    for weight, block in (term.args, term.args[::-1]):
        attention = attention_of(r, block)
        w = r.u[weight]
        if attention is None or w.op != "bcast" or w.attrs[0] != tuple(range(len(w.shape) - 1)):
            continue
        power, box = r.as_region(w.args[0])  # exp(...), or a rank's rows of it
        perm = None
        if r.op(power) == "permute":  # weights computed with the rows in another order, put back
            perm = r.u[power].attrs[0]
            power, box = r.u[power].args[0], tuple(box[perm.index(d)] for d in range(len(perm)))
        exponent = r.u[r.slice(r.u[power].args[0], box)] if r.op(power) == "exp" else None
        if exponent is None or exponent.op != "lin" or sorted(exponent.attrs[0]) != [-1, 1]:
            continue
        lses = exponent.args if exponent.attrs[0][0] == 1 else exponent.args[::-1]
        own, total = (_as_lse(r, a if perm is None else r.permute(a, perm)) for a in lses)
        if own is not None and total is not None and own[0] == attention[0]:
            return attention[0], attention[1], total
    return None


def _as_lse(r: Rules, t: int) -> tuple[int, int] | None:
    """(scores, dim) with t = LSE(scores, dim): an LSE term or a region of one along kept dims (a
    rank's rows of the whole's)."""
    root, box = r.as_region(t)
    term = r.u[root]
    if term.op != LSE:
        return None
    (dim,) = term.attrs
    scores = term.args[0]
    if root == t:
        return scores, dim
    full = (0, r.shape(scores)[dim])
    return r.slice(scores, box[:dim] + (full,) + box[dim:]), dim

