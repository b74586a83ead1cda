"""The lines a report may name first for a mutant: where the programmer has to change the code.

For most mutants that is the mutated line. A deleted collective is another matter: the line it stood
on no longer makes any op, and tests/cases/README.md's markers put a missing collective at the op
that produces the value it should have reduced (or gathered). So for a deleted collective the
lines are the mutated one plus, for every collective the original program issues and the mutant no
longer does, the line of the op that made its operand (and of the ops that only moved it on the
way: a view, a permute, a cast). Which collectives are gone is read off the two programs as traced
(torch's stack traces, through shardproof's capture, not its prover): their (op, line) counts on
rank 0.
"""

from __future__ import annotations

import collections
from pathlib import Path

MOVING = {"view", "permute", "expand", "convert"}  # ops that pass a value on unchanged


def fault_lines(operator: str, lines: range, original: Path, mutant: Path, world_size: int) -> set[int]:
    """The lines of `original` a report may name first for the mutant (same line numbers in both)."""
    wanted = set(lines)
    if operator != "collective deleted":
        return wanted
    try:
        before, after = _rank0(original, world_size), _rank0(mutant, world_size)
    except Exception:  # noqa: BLE001 - a program that does not trace keeps the mutated line alone
        return wanted
    left = collections.Counter(_key(n) for n in _collectives(after))
    gone = [n for n in _collectives(before) if left[_key(n)] < sum(_key(m) == _key(n) for m in _collectives(before))]
    for node in gone:
        wanted |= _producer_lines(before, node, original.name)
    return wanted


def _rank0(path: Path, world_size: int):
    from shardproof.capture.torch_capture import capture
    from shardproof.case import load_case

    case = load_case(path)
    with case.importable():
        return capture(case, world_size, mode=case.resolve_mode(False, False), memo=False).ranks[0]


def _collectives(graph) -> list:
    from shardproof.ir.ops import OPS

    return [n for n in graph.nodes if OPS[n.op].kind == "collective"]


def _key(node) -> tuple:
    return node.op, node.loc.line if node.loc else 0, bool(node.loc and node.loc.backward)


def _producer_lines(graph, collective, name: str) -> set[int]:
    lines, node = set(), graph[collective.inputs[0]]
    while True:
        if node.loc is not None and Path(node.loc.file).name == name:
            lines.add(node.loc.line)
        if node.op not in MOVING or not node.inputs:
            return lines
        node = graph[node.inputs[0]]
