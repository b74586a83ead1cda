"""Fuzz `verify-graphs` with corrupted copies of graph dumps: the real ones of ../shared/data/entangle
and small generated HLO and FX pairs.

Each trial corrupts one file of a pair (truncation, a line deleted, duplicated or swapped, a token
or a shape number changed, invalid UTF-8, binary noise), verifies the pair in this process and
sorts the outcome. A corrupted input must be rejected as unusable (exit 2), or, if accepted, mean
the program it was: the mutant side is compared with the original side, node for node on their IR
(commutative operands in any order, inputs by name, else by position) and, when small enough, numerically on
random inputs. The failures are a traceback (any exception but shardproof's input errors), a
timeout, `equivalent` for a program that is not the same, and `discrepancy` on a corrupted copy of
a correct pair that still means the same program.

    python bench/fuzz.py --n 10000 --seed 1     # prints a table of outcomes, then the failures
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "entangle"
REAL_PAIRS = [  # (reference, distributed) of ../shared/data/entangle
    ("aws_llama/tp1_layer1", "aws_llama/tp2_layer1"),
    ("aws_llama/tp1_layer1", "aws_llama/tp4_layer1"),
    ("aws_llama/tp1_layer2", "aws_llama/tp2_layer2"),
    ("gpt/paral1_layer1", "gpt/paral2_layer1"),
    ("gpt/paral1_layer2", "gpt/paral2_layer2"),
    ("qwen2/paral1_layer1", "qwen2/paral2_layer1"),
    ("bug_grad_accumulation/1step", "bug_grad_accumulation/2step.bug"),
    ("bug_missing_layernorm_allreduce/tp1", "bug_missing_layernorm_allreduce/tp2.bug"),
]
NUMERIC_LIMIT = 2_000_000  # elements over all nodes of a side run numerically to compare a mutant
FAILURES = ("traceback", "timeout", "equivalent, wrongly", "discrepancy, same program")
OUTCOMES = (
    "rejected (exit 2)",
    "unknown (exit 2)",
    "equivalent, same program",
    "equivalent, unconfirmed (too large to run)",
    "discrepancy, program changed",
    "discrepancy, as the uncorrupted buggy pair",
    "discrepancy, unconfirmed (too large to run)",
    *FAILURES,
)


# --- mutations: bytes -> bytes, each seeded by the trial's rng ---------------------------------------
def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def delete_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    del lines[rng.randrange(len(lines))]
    return b"".join(lines)


def duplicate_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i = rng.randrange(len(lines))
    lines.insert(rng.randrange(len(lines) + 1), lines[i])
    return b"".join(lines)


def swap_lines(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i = rng.randrange(len(lines))
    j = min(len(lines) - 1, i + 1) if rng.random() < 0.5 else rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"".join(lines)


_TOKEN = re.compile(rb"[A-Za-z_%][\w.\-]*|\d+")


def change_token(data: bytes, rng: random.Random) -> bytes:
    """One word or number of a line replaced by another of the file's words or numbers."""
    tokens = list(_TOKEN.finditer(data))
    target = rng.choice(tokens)
    numeric = target.group(0).isdigit()
    pool = [t.group(0) for t in rng.sample(tokens, min(200, len(tokens))) if t.group(0).isdigit() == numeric]
    return data[: target.start()] + rng.choice(pool) + data[target.end() :]


_SHAPE_NUMBER = re.compile(rb"(?<=[\[{,:\s])\d+(?=\s*[\]},:])")


def change_shape_number(data: bytes, rng: random.Random) -> bytes:
    """A number inside `[...]` or `{...}` (dims, layouts, slices, groups, split sizes) changed."""
    found = list(_SHAPE_NUMBER.finditer(data))
    if not found:
        return change_token(data, rng)
    target = rng.choice(found)
    n = int(target.group(0))
    new = rng.choice([n + 1, max(0, n - 1), n * 2, n // 2, 0, 1, rng.randrange(1, 64)])
    return data[: target.start()] + str(new).encode() + data[target.end() :]


def invalid_utf8(data: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(data) + 1)
    return data[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\x80\x80", b"\xfe\xff"]) + data[at:]


def binary(data: bytes, rng: random.Random) -> bytes:
    noise = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096)))
    return noise if rng.random() < 0.5 else data[: rng.randrange(len(data))] + noise


MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    f.__name__: f
    for f in (truncate, delete_line, duplicate_line, swap_lines, change_token, change_shape_number, invalid_utf8, binary)
}


# --- the pairs ----------------------------------------------------------------------------------------
@dataclass
class Subject:
    """A pair of graph dumps and the verdict the uncorrupted pair gets."""

    name: str
    reference: Path
    distributed: Path
    verdict: str = ""
    programs: tuple | None = None  # (reference Program, distributed Program) of the uncorrupted pair

    def files(self) -> list[tuple[str, Path]]:
        from shardproof.importers.sources import graph_files

        return [(side, f) for side in ("reference", "distributed") for graphs in graph_files(getattr(self, side), side) for f in graphs]


def real_subjects() -> list[Subject]:
    if not DATA.is_dir():
        return []
    return [Subject(dist, DATA / ref, DATA / dist) for ref, dist in REAL_PAIRS]


_HLO_ADD = "%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n  ROOT %c = f32[] add(%a, %b)\n}\n"


def hlo_mlp(ffn: int, reduce: bool) -> str:
    """An MLP block in HLO: transpose, reshape, broadcast, dot, slice, concatenate, reduce; on TP
    ranks (ffn halved) the down projection's partial sums are all-reduced."""
    out = "%summed" if reduce else "%down_out"
    return "\n".join([
        "HloModule mlp", "", _HLO_ADD,
        f"ENTRY %main (x: f32[2,3,4], up: f32[4,{2 * ffn}], down: f32[{ffn},4], bias: f32[4]) -> (f32[3,2,4], f32[3,4]) {{",
        "  %x = f32[2,3,4]{2,1,0} parameter(0)",
        f"  %up = f32[4,{2 * ffn}]{{1,0}} parameter(1)",
        f"  %down = f32[{ffn},4]{{1,0}} parameter(2)",
        "  %bias = f32[4]{0} parameter(3)",
        "  %xt = f32[3,2,4]{2,1,0} transpose(%x), dimensions={1,0,2}",
        "  %rows = f32[6,4]{1,0} reshape(%xt)",
        f"  %h = f32[6,{2 * ffn}]{{1,0}} dot(%rows, %up), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
        f"  %g = f32[6,{ffn}]{{1,0}} slice(%h), slice={{[0:6], [0:{ffn}]}}",
        f"  %u = f32[6,{ffn}]{{1,0}} slice(%h), slice={{[0:6], [{ffn}:{2 * ffn}]}}",
        f"  %sig = f32[6,{ffn}]{{1,0}} logistic(%g)",
        f"  %act = f32[6,{ffn}]{{1,0}} multiply(%g, %sig)",
        f"  %y = f32[6,{ffn}]{{1,0}} multiply(%act, %u)",
        "  %down_out = f32[6,4]{1,0} dot(%y, %down), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        *(["  %summed = f32[6,4]{1,0} all-reduce(%down_out), replica_groups={{0,1}}, to_apply=%add"] if reduce else []),
        "  %b = f32[6,4]{1,0} broadcast(%bias), dimensions={1}",
        f"  %biased = f32[6,4]{{1,0}} add({out}, %b)",
        "  %out = f32[3,2,4]{2,1,0} reshape(%biased)",
        "  %zero = f32[] constant(0)",
        "  %total = f32[3,4]{1,0} reduce(%out, %zero), dimensions={1}, to_apply=%add",
        "  ROOT %t = (f32[3,2,4], f32[3,4]) tuple(%out, %total)",
        "}",
    ])  # fmt: skip


def fx_mlp(ffn: int, reduce: bool) -> str:
    """An MLP block as an FX readable dump: fused gate/up split with split_with_sizes, SwiGLU,
    views and a permute; on TP ranks the down projection is all-reduced."""
    tail = [
        "        all_reduce: \"f32[6, 4]\" = torch.ops._c10d_functional.all_reduce.default(mm_1, 'sum', '0')",
        '        summed: "f32[6, 4]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None',
    ] if reduce else ['        summed: "f32[6, 4]" = torch.ops.aten.clone.default(mm_1)']
    return "\n".join([
        "class GraphModule(torch.nn.Module):",
        f'    def forward(self, x: "f32[2, 3, 4]", up: "f32[4, {2 * ffn}]", down: "f32[{ffn}, 4]", bias: "f32[4]"):',
        "        # File: /work/model.py:10 in forward, code: h = x.transpose(0, 1).reshape(6, 4) @ self.up",
        '        permute: "f32[3, 2, 4]" = torch.ops.aten.permute.default(x, [1, 0, 2])',
        '        clone: "f32[3, 2, 4]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format)',
        '        view: "f32[6, 4]" = torch.ops.aten.view.default(clone, [6, 4])',
        f'        mm: "f32[6, {2 * ffn}]" = torch.ops.aten.mm.default(view, up)',
        "        # File: /work/model.py:11 in forward, code: g, u = h.split([F, F], -1)",
        f"        split_with_sizes = torch.ops.aten.split_with_sizes.default(mm, [{ffn}, {ffn}], 1)",
        f'        getitem: "f32[6, {ffn}]" = split_with_sizes[0]',
        f'        getitem_1: "f32[6, {ffn}]" = split_with_sizes[1];  split_with_sizes = None',
        "        # File: /work/model.py:12 in forward, code: y = F.silu(g) * u @ self.down",
        f'        silu: "f32[6, {ffn}]" = torch.ops.aten.silu.default(getitem)',
        f'        mul: "f32[6, {ffn}]" = torch.ops.aten.mul.Tensor(silu, getitem_1)',
        '        mm_1: "f32[6, 4]" = torch.ops.aten.mm.default(mul, down)',
        *tail,
        "        # File: /work/model.py:13 in forward, code: return (y + self.bias).view(3, 2, 4)",
        '        add: "f32[6, 4]" = torch.ops.aten.add.Tensor(summed, bias)',
        '        view_1: "f32[3, 2, 4]" = torch.ops.aten.view.default(add, [3, 2, 4])',
        '        sum_1: "f32[3, 4]" = torch.ops.aten.sum.dim_IntList(view_1, [1])',
        "        return (view_1, sum_1)",
        "",
    ])  # fmt: skip


def generated_subjects(directory: Path) -> list[Subject]:
    """The generated HLO pair (an SPMD module for 2 ranks) and FX pair (one dump per rank)."""
    (directory / "fx_tp2").mkdir(parents=True, exist_ok=True)
    (directory / "ref.hlo").write_text(hlo_mlp(6, reduce=False))
    (directory / "tp2.hlo").write_text(hlo_mlp(3, reduce=True))
    (directory / "ref.py").write_text(fx_mlp(6, reduce=False))
    for rank in (0, 1):
        (directory / "fx_tp2" / f"fw.g0.r{rank}.py").write_text(fx_mlp(3, reduce=True))
    return [
        Subject("generated hlo", directory / "ref.hlo", directory / "tp2.hlo"),
        Subject("generated fx", directory / "ref.py", directory / "fx_tp2"),
    ]


# --- one trial ----------------------------------------------------------------------------------------
@dataclass
class Trial:
    subject: str
    mutation: str
    file: str
    outcome: str
    detail: str = ""


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # noqa: ANN001 - signal handler
    raise _Timeout()


def prepare(subject: Subject) -> None:
    """The uncorrupted pair's verdict and programs, against which mutants are judged."""
    from shardproof.importers.verify import import_pair, verify_graphs

    subject.verdict = verify_graphs(subject.reference, subject.distributed).verdict
    pair = import_pair(subject.reference, subject.distributed)
    subject.programs = (pair.reference, pair.distributed)


def trial(subject: Subject, rng: random.Random, workdir: Path, timeout: float) -> Trial:
    """Corrupt one file of the pair, verify, and judge the outcome."""
    from shardproof.errors import ShardproofError
    from shardproof.importers.verify import import_pair, verify_graphs

    side, original = rng.choice(subject.files())
    mutation = rng.choice(list(MUTATIONS))
    sides = {"reference": subject.reference, "distributed": subject.distributed}
    sides[side] = _corrupted_copy(sides[side], original, MUTATIONS[mutation](original.read_bytes(), rng), workdir)
    where = f"{original.parent.name}/{original.name}"
    make = lambda outcome, detail="": Trial(subject.name, mutation, where, outcome, detail)  # noqa: E731
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(timeout))
    try:
        report = verify_graphs(sides["reference"], sides["distributed"])
        if report.verdict == "unknown":
            return make("unknown (exit 2)", report.diagnosis or "")
        pair = import_pair(sides["reference"], sides["distributed"])
        mutant = pair.reference if side == "reference" else pair.distributed
        same = same_program(subject.programs[0 if side == "reference" else 1], mutant)
    except ShardproofError as err:
        return make("rejected (exit 2)", str(err))
    except _Timeout:
        return make("timeout", f"over {timeout:.0f} s")
    except Exception as err:  # noqa: BLE001 - the failure this bench counts
        frame = traceback.extract_tb(err.__traceback__)[-1]
        return make("traceback", f"{type(err).__name__}: {err} ({Path(frame.filename).name}:{frame.lineno})")
    finally:
        signal.alarm(0)
        shutil.rmtree(sides[side] if sides[side].is_dir() else sides[side].parent, ignore_errors=True)
    return make(*_judged(report, same, subject.verdict))


def _judged(report, same: bool | None, expected: str) -> tuple[str, str]:  # noqa: ANN001 - a Report
    """`equivalent` must be the uncorrupted pair's verdict on the same program; `discrepancy` on a
    correct pair must come with a changed program."""
    diagnosis = report.diagnosis or ""
    if same is None:
        return f"{report.verdict}, unconfirmed (too large to run)", diagnosis
    if report.verdict == "equivalent":
        return ("equivalent, same program", "") if same and expected == "equivalent" else ("equivalent, wrongly", f"same program: {same}")
    if not same:
        return "discrepancy, program changed", diagnosis
    if expected == "equivalent":
        return "discrepancy, same program", diagnosis
    return "discrepancy, as the uncorrupted buggy pair", diagnosis


def _corrupted_copy(side: Path, original: Path, data: bytes, workdir: Path) -> Path:
    """The side (a file or a directory of rank files) copied with `original` replaced by `data`."""
    target = Path(tempfile.mkdtemp(dir=workdir))
    if side.is_file():
        (target / side.name).write_bytes(data)
        return target / side.name
    for f in side.iterdir():
        if f.is_file():
            (target / f.name).write_bytes(data if f == original else f.read_bytes())
    return target


# --- the same program? ------------------------------------------------------------------------------
_COMMUTATIVE = {"add", "mul", "maximum", "minimum", "eq", "ne", "logical_and", "logical_or"}


def same_program(original, mutant) -> bool | None:  # noqa: ANN001 - importers' Program
    """Whether two imports of one side mean the same program: True if their IR graphs are the same
    node for node (inputs matched by name, or by position where the names differ; commutative
    operands in any order) or, when small enough to run, compute the same numbers; None when they
    differ in form and are too large to run."""
    if original.world_size != mutant.world_size:
        return False
    pairs = list(zip(original.graphs, mutant.graphs))
    matched = [_matched_inputs(a, b) for a, b in pairs]
    if any(m is None for m in matched):
        return False
    ids: dict[tuple, int] = {}  # one numbering for both, so equal ids mean equal terms
    slots = [({i.node: k for k, (i, _) in enumerate(m)}, {j.node: k for k, (_, j) in enumerate(m)}) for m in matched]
    if all(_canonical(a, ids, sa) == _canonical(b, ids, sb) for (a, b), (sa, sb) in zip(pairs, slots)):
        return True
    if max(_elements(g.graph) for _, g in pairs) > NUMERIC_LIMIT or _elements(pairs[0][0].graph) > NUMERIC_LIMIT:
        return None
    return _same_numbers(original, mutant)


def _matched_inputs(a, b) -> list[tuple] | None:  # noqa: ANN001 - two ImportedGraphs
    """Their inputs in pairs, by name when both have the same names (a dump's lines reordered), else
    by position; None when a pair differs in shape or dtype."""
    by_name = {i.name: i for i in b.inputs}
    same_names = len(by_name) == len(b.inputs) == len(a.inputs) and by_name.keys() == {i.name for i in a.inputs}
    pairs = [(i, by_name[i.name]) for i in a.inputs] if same_names else list(zip(a.inputs, b.inputs))
    if len(a.inputs) != len(b.inputs) or any((i.shape, i.dtype) != (j.shape, j.dtype) for i, j in pairs):
        return None
    return pairs


def _canonical(imported, ids: dict[tuple, int], slot: dict[int, int]) -> tuple:  # noqa: ANN001 - an ImportedGraph
    """The outputs, and the collectives issued in order (a rank's calls other ranks must match,
    used or not), as hash-consed ids of (op, attrs, shape, dtype, operands); inputs by `slot`."""
    of: dict[int, int] = {}
    for node in imported.graph.nodes:
        operands = [of[i] for i in node.inputs]
        if node.op in _COMMUTATIVE:
            operands.sort()
        attrs = ("input", slot[node.id]) if node.id in slot else repr(node.attrs)
        key = (node.op, attrs, node.shape, node.dtype, tuple(operands))
        of[node.id] = ids.setdefault(key, len(ids))
    collectives = tuple(of[n.id] for n in imported.graph.nodes if n.op in ("all_reduce", "all_gather", "reduce_scatter"))
    return tuple(of[o] for o in imported.graph.outputs), collectives


def _elements(graph) -> int:  # noqa: ANN001
    import math

    return sum(math.prod(n.shape) for n in graph.nodes)


def _same_numbers(original, mutant) -> bool:  # noqa: ANN001
    """Both run on the same random inputs (bound by name, else by position) give the same outputs."""
    import torch

    from shardproof.importers.numeric import random_leaves
    from shardproof.ir.run import run_ranks

    leaves = random_leaves(original.graphs[0].graph)
    for rank_graph in original.graphs[1:]:
        leaves.update({k: v for k, v in random_leaves(rank_graph.graph).items() if k not in leaves})
    renamed = dict(leaves)
    for a, b in zip(original.graphs, mutant.graphs):
        renamed.update({j.name: leaves[i.name] for i, j in _matched_inputs(a, b)})
    try:
        want = run_ranks([g.graph for g in original.graphs], leaves)
        got = run_ranks([g.graph for g in mutant.graphs], renamed)
    except Exception:  # noqa: BLE001 - a mutant that cannot run (a lookup out of range) is not the same program
        return False
    return all(
        len(w) == len(g) and all(x.shape == y.shape and torch.allclose(x.double(), y.double(), equal_nan=True) for x, y in zip(w, g))
        for w, g in zip(want, got)
    )


# --- the run --------------------------------------------------------------------------------------
def run(subjects: list[Subject], n: int, seed: int, timeout: float = 120.0, log: Callable[[str], None] = lambda _: None) -> list[Trial]:
    """n seeded trials spread over the subjects (their uncorrupted verdicts computed first)."""
    rng = random.Random(seed)
    for subject in subjects:
        prepare(subject)
    trials = []
    with tempfile.TemporaryDirectory() as workdir:
        for k in range(n):
            trials.append(trial(rng.choice(subjects), random.Random(rng.getrandbits(64)), Path(workdir), timeout))
            if trials[-1].outcome in FAILURES:
                log(f"trial {k}: {_failure(trials[-1])}")
            if (k + 1) % 100 == 0:
                log(f"{k + 1}/{n}: {dict(Counter(t.outcome for t in trials))}")
    return trials


def summary(trials: list[Trial]) -> str:
    counts = Counter(t.outcome for t in trials)
    width = max(len(o) for o in OUTCOMES)
    rows = [f"{'outcome':<{width}}  {'count':>6}", f"{'-' * width}  {'-' * 6}"]
    rows += [f"{o:<{width}}  {counts[o]:>6}" + ("  <- failure" if o in FAILURES and counts[o] else "") for o in OUTCOMES]
    rows.append(f"{'total':<{width}}  {len(trials):>6}")
    by_mutation = Counter((t.mutation, t.outcome in ("rejected (exit 2)", "unknown (exit 2)")) for t in trials)
    rows += ["", "rejected per mutation: " + ", ".join(
        f"{m} {by_mutation[(m, True)]}/{by_mutation[(m, True)] + by_mutation[(m, False)]}" for m in MUTATIONS
    )]  # fmt: skip
    return "\n".join(rows)


def _failure(t: Trial) -> str:
    return f"{t.outcome}: {t.subject} {t.file} ({t.mutation}): {t.detail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="number of corrupted inputs (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per trial (default 120)")
    parser.add_argument("--only", help="the subjects whose name contains this text")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as generated:
        subjects = real_subjects() + generated_subjects(Path(generated))
        subjects = [s for s in subjects if not args.only or args.only in s.name]
        start = time.perf_counter()
        trials = run(subjects, args.n, args.seed, args.timeout, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{args.n} corrupted inputs, seed {args.seed}, {len(subjects)} pairs, {time.perf_counter() - start:.0f} s\n")
    print(summary(trials))
    failures = [t for t in trials if t.outcome in FAILURES]
    for t in failures:
        print(f"- {_failure(t)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
