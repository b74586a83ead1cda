"""End to end on the bug corpus (tests/cases) and the examples: verdict, culprit line, kind of
fault, and agreement with the numeric oracle (the verifier is checked, not the user)."""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from pathlib import Path

import pytest

from shardproof import verify
from shardproof.case import load_case
from shardproof.errors import CaseError
from shardproof.oracle import run_numeric
from shardproof.programs import NumericResult

CASES = Path(__file__).parent / "cases"
EXAMPLES = Path(__file__).parent.parent / "examples"
KIND_WORDS = {
    "partial": "missing reduction",
    "double-count": "double counting",
    "scale": "wrong scale",
    "layout": "wrong layout",
    "wrong-group": "wrong group",
    "double-reduction": "double reduction",
    "missing-backward": "missing backward step",
    "unwritten": "uninitialised memory read",
    "too-few": "too few candidates",
    "mismatched": "mismatched collectives",
}


def _params(paths: list[Path], world_sizes: list[int] | None = None, slow_from: int | None = None) -> list:
    """One param per path (and world size); those at `slow_from` ranks or more are marked slow."""
    if world_sizes is None:
        return [pytest.param(p, id=p.stem) for p in paths]
    slow = lambda n: [pytest.mark.slow] if slow_from is not None and n >= slow_from else []  # noqa: E731
    return [pytest.param(p, n, id=f"{p.stem}-{n}", marks=slow(n)) for p in paths for n in world_sizes]


def _marker(path: Path, tag: str) -> tuple[int, str] | None:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        found = re.search(rf"# {tag}(\((?P<kind>[a-z-]+)\))?", line)
        if found:
            return number, found["kind"] or ""
    return None


def _world_size(path: Path) -> int:
    case = load_case(path)
    return int(getattr(case.module, "BUG_WORLD_SIZE", case.world_size))


def _checked(path: Path, world_size: int):
    report = verify(path, world_size=world_size)
    try:
        numbers = run_numeric(load_case(path), world_size)
    except (CaseError, RuntimeError) as err:  # a real run fails: ranks whose collectives do not pair up, and only they
        assert report.kind == "mismatched collectives", f"the program raises ({err}) but the report says {report.diagnosis}"
        return report, NumericResult(False, math.inf, math.inf, str(err), {})
    if report.verdict == "equivalent":
        assert numbers.agree, f"proven equivalent but the numbers differ: {numbers.detail}"
    if report.verdict == "discrepancy":
        assert not numbers.agree, f"discrepancy reported but the numbers agree: {report.diagnosis}"
        assert set(report.claims) <= set(numbers.differing), f"claims {report.claims} named failing, numbers differ " \
            f"in {list(numbers.differing)}"
    return report, numbers


@pytest.mark.parametrize("path", _params(sorted(CASES.glob("*_buggy.py"))))
def test_buggy_case_is_a_discrepancy_at_the_marked_line(path: Path) -> None:
    line, kind = _marker(path, "BUG")
    report, numbers = _checked(path, _world_size(path))
    assert report.verdict == "discrepancy", report.diagnosis
    sites = report.distributed or report.reference
    if kind == "partial" and sites[0].op.endswith(" in the backward") and ".backward(" in sites[0].code:
        sites = sites[1:]  # a gradient handed over unreduced: the step's backward() call first (grad_sync.py)
    culprit = sites[0]
    assert (Path(culprit.file).name, culprit.line) == (path.name, line), report.diagnosis
    assert KIND_WORDS[kind] in report.diagnosis
    wrong_gradients = [claim for claim in numbers.differing if claim.startswith("gradient of")]
    if wrong_gradients:  # a wrong gradient trains a worse model: it leads, even when the loss is wrong too
        assert report.claims[:1] and report.claims[0] in wrong_gradients, report.diagnosis


@pytest.mark.parametrize(
    ("path", "world_size"), _params(sorted([*CASES.glob("*_fixed.py"), *CASES.glob("*_lookalike.py")]), [1, 2, 4])
)
def test_fixed_case_and_lookalike_are_proven(path: Path, world_size: int) -> None:
    report, numbers = _checked(path, world_size)
    assert numbers.agree
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("name", "mode"), [("einsum-row-parallel", "train"), ("interleaved-qkv", "forward")])
def test_equivalent_refactorings_are_proven_in_their_other_mode(name: str, mode: str, world_size: int, checked) -> None:
    """Issue 14's refactorings, proven above in their own mode, in the other: einsum's product trained
    (its weight gradient a bmm over a batch of one, transposed back), the interleaved QKV's forward."""
    case = load_case(CASES / f"{name}_lookalike.py")
    case.mode = mode
    report = checked(case, world_size)
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.parametrize(("world_size", "train"), [(2, True), pytest.param(8, False, marks=pytest.mark.slow),
                                                  pytest.param(4, True, marks=pytest.mark.slow),
                                                  pytest.param(8, True, marks=pytest.mark.slow)])
def test_context_parallel_case_is_proven_at_more_ranks_and_trained(world_size: int, train: bool) -> None:
    """Zigzag KV all-gather context parallelism (the fixed case runs forward at 1, 2, 4 above)."""
    path = CASES / "cp-zigzag-mask_fixed.py"
    report = verify(path, world_size=world_size, train=train)
    assert run_numeric(load_case(path), world_size, mode="train" if train else None).agree
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_the_causal_ring_attention_example_is_proven_in_training(world_size: int) -> None:
    """examples/llama_cp.py (forward at 1, 2, 4, 8 below): the ring's backward, dK and dV sent back round the ring."""
    path = EXAMPLES / "llama_cp.py"
    report = verify(path, world_size=world_size, train=True)
    assert run_numeric(load_case(path), world_size, mode="train").agree
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["moe_ep.py", "deepseek_v3.py"])
def test_the_expert_parallel_examples_are_proven_in_training(name: str, world_size: int) -> None:
    """examples/moe_ep.py and deepseek_v3.py (EP x TP; forward at 1, 2, 4, 8 below): the routers'
    gradients too, their gates' gradient returned per peer by the inverse all_to_all."""
    path = EXAMPLES / name
    report = verify(path, world_size=world_size, train=True)
    assert run_numeric(load_case(path), world_size, mode="train").agree
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.parametrize(("world_size", "train"), [(2, True), (4, False), pytest.param(8, False, marks=pytest.mark.slow),
                                                  pytest.param(4, True, marks=pytest.mark.slow),
                                                  pytest.param(8, True, marks=pytest.mark.slow)])
def test_the_expert_parallel_example_is_proven_with_its_experts_tensor_parallel(world_size: int, train: bool) -> None:
    """examples/moe_ep.py's preset `small-etp`: an (ep, tp) grid, every expert's hidden split over a
    TP group whose tokens are gathered first and reduce-scattered after; the router's gradient is a
    share over the rank's tokens of a share over its block of the hidden, summed over the grid."""
    case = load_case(EXAMPLES / "moe_ep.py")
    case.use_preset("small-etp")
    report = verify(case, world_size=world_size, train=train)
    assert run_numeric(case, world_size, mode="train" if train else None).agree
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.parametrize(("world_size", "mode"), [(2, "forward"), (4, "forward"), pytest.param(8, "forward", marks=pytest.mark.slow),
                                                 pytest.param(8, "train", marks=pytest.mark.slow)])
def test_sentinel_slots_case_is_proven_forward_and_at_eight_ranks(world_size: int, mode: str, checked) -> None:
    """Expert parallelism with sentinel slots (trained at 1, 2, 4 above): the forward, and eight
    ranks of one expert each, whose one-hot of one column the backward transposes by a reshape."""
    case = load_case(CASES / "sentinel-expert-grad_fixed.py")
    case.mode = mode
    report = checked(case, world_size)
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.slow
def test_ulysses_case_is_proven_at_eight_ranks() -> None:
    """Two heads and two tokens per rank (the fixed case runs at 1, 2, 4 above)."""
    report, numbers = _checked(CASES / "ulysses-gather-dim_fixed.py", 8)
    assert numbers.agree and report.verdict == "equivalent", report.diagnosis


def _examples() -> list:
    return _params(sorted(p for p in EXAMPLES.glob("*.py") if "def distributed(" in p.read_text()), [1, 2, 4, 8], 4)


@pytest.mark.parametrize(("path", "world_size"), _examples())
def test_example_is_proven(path: Path, world_size: int) -> None:
    report, _ = _checked(path, world_size)
    assert report.verdict == "equivalent", report.diagnosis


@contextmanager
def _variant(path: Path, **settings):
    """The example's case with module settings changed (its default schedule, stages, ties) while in use."""
    case = load_case(path)
    saved = {name: getattr(case.module, name) for name in settings}
    vars(case.module).update(settings)
    try:
        yield case
    finally:
        vars(case.module).update(saved)


def _proven_with_oracle(case, world_size: int) -> None:
    report = verify(case, world_size=world_size)
    numbers = run_numeric(case, world_size)
    assert numbers.agree, numbers.detail
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(("schedule", "chunks"), [("gpipe", 1), ("interleaved", 2), ("gpipe", 2)])
def test_the_pipeline_example_is_proven_under_other_schedules(schedule: str, chunks: int, world_size: int) -> None:
    """The example's default schedule is 1F1B with one stage per rank (above). GPipe runs every
    forward before any backward; interleaved 1F1B runs two virtual stages per rank (chunks r and
    r + n), their messages crossing from the last rank back to the first."""
    with _variant(EXAMPLES / "mlp_pp.py", SCHEDULE=schedule, CHUNKS=chunks) as case:
        _proven_with_oracle(case, world_size)


@pytest.mark.slow
@pytest.mark.parametrize(("settings", "world_size"), [
    ({"TIED": True}, 1), ({"TIED": True}, 2), ({"TIED": True}, 4), ({"TIED": True}, 8),
    ({"MAX_STAGES": 2}, 4), ({"MAX_STAGES": 2, "TIED": True}, 4),
    ({"SCHEDULE": "interleaved", "CHUNKS": 2}, 1), ({"SCHEDULE": "interleaved", "CHUNKS": 2}, 2),
    ({"SCHEDULE": "interleaved", "CHUNKS": 2, "MAX_STAGES": 2}, 4),
])
def test_the_llama_pipeline_is_proven_tied_interleaved_and_on_2d_layouts(settings: dict, world_size: int) -> None:
    """lm_head tied to the embedding (the first and last stage all-reduce its gradient), two
    pipelines of 2 stages, and interleaved 1F1B over two virtual stages per rank."""
    with _variant(EXAMPLES / "llama_pp.py", **settings) as case:
        _proven_with_oracle(case, world_size)


@pytest.mark.parametrize(("tp", "world_size", "mode"), [
    (1, 2, "train"),  # 2x1: FSDP2 alone on the Llama
    (2, 2, "forward"),  # 1x2: one data-parallel group reads the whole batch, its output the reference's
    pytest.param(4, 4, "forward", marks=pytest.mark.slow),
    pytest.param(4, 8, "train", marks=pytest.mark.slow),  # 2x4
])
def test_fsdp_over_tp_is_proven_on_other_meshes(tp: int, world_size: int, mode: str) -> None:
    """examples/llama_fsdp_tp.py on (dp, tp) meshes other than its default TP of 2 gives (1x2, 2x2,
    4x2 trained above), and its forward."""
    with _variant(EXAMPLES / "llama_fsdp_tp.py", TP=tp) as case:
        case.mode = mode
        _proven_with_oracle(case, world_size)


@pytest.mark.parametrize("world_size", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_hsdp_is_proven(world_size: int) -> None:
    """examples/mlp_fully_shard.py as HSDP: fully_shard on a (replicate, shard) mesh of 2 groups."""
    with _variant(EXAMPLES / "mlp_fully_shard.py", REPLICAS=2) as case:
        _proven_with_oracle(case, world_size)
