"""The Llama examples trace with make_fx on fake tensors under the fake process group.

Small config at world size 2 (every rank), and the real Llama 3 8B shapes (reduced to 2 layers) for
rank 0 of 8: no weights are allocated, so the full vocab/hidden/ffn sizes cost nothing.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardproof.case import Case, load_case
from shardproof.state import module_state, rank_state

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LLAMA_CASES = ("llama_tp.py", "llama_dtensor.py")
COLLECTIVES = ("c10d.allreduce_", "c10d.allgather_", "_c10d_functional.all_reduce", "_c10d_functional.all_gather")


def _output_shape(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return tuple(out.args[0].meta["val"].shape)


def _trace(case: Case, world_size: int, ranks: list[int]) -> tuple[torch.fx.GraphModule, list[torch.fx.GraphModule]]:
    """The reference graph and the graphs of `ranks`, each traced under a fresh fake process group."""
    reference = None
    graphs = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            with FakeTensorMode():
                ref = case.reference()
                model = case.distributed(rank, world_size)
                ref_state = module_state(ref)
                state = rank_state(case, ref_state, model, rank, world_size)
                inputs = case.inputs()
                graphs.append(
                    make_fx(lambda *a: functional_call(model, state, a), tracing_mode="real", record_stack_traces=True)(
                        *inputs
                    )
                )
                if reference is None:
                    reference = make_fx(
                        lambda *a: functional_call(ref, ref_state, a), tracing_mode="real", record_stack_traces=True
                    )(*inputs)
        finally:
            dist.destroy_process_group()
    return reference, graphs


def _check(case: Case, world_size: int, ranks: list[int]) -> None:
    config = sys.modules[case.reference.__module__].CONFIG
    reference, graphs = _trace(case, world_size, ranks)
    expected = (config.batch, config.seq, config.vocab)
    assert _output_shape(reference) == expected
    for rank, gm in zip(ranks, graphs):
        assert _output_shape(gm) == expected, f"rank {rank}: output is not the replicated logits"
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert any(t.startswith(COLLECTIVES) for t in targets), f"rank {rank}: no collective traced"
        user_lines = [n for n in gm.graph.nodes if str(EXAMPLES) in (n.meta.get("stack_trace") or "")]
        assert user_lines, f"rank {rank}: no node carries a stack trace into the example's source"


@pytest.mark.parametrize("name", LLAMA_CASES)
def test_small_config_traces_every_rank(name: str) -> None:
    _check(load_case(EXAMPLES / name), 2, [0, 1])


@pytest.mark.parametrize("name", LLAMA_CASES)
def test_llama3_8b_shapes_trace(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = load_case(EXAMPLES / name)
    module = sys.modules[case.reference.__module__]
    monkeypatch.setattr(module, "CONFIG", dataclasses.replace(module.PRESETS["llama3-8b"], n_layers=2))
    _check(case, 8, [0])


def _assert_proven(case: Case, world_size: int, train: bool = False) -> None:
    """Proven equivalent (one training step's loss and gradients with `train`), and the numeric
    oracle agrees."""
    from shardproof import verify
    from shardproof.oracle import run_numeric

    report = verify(case, world_size=world_size, train=train)
    assert report.verdict == "equivalent", report.diagnosis
    assert run_numeric(case, world_size, mode=case.resolve_mode(train)).agree


@pytest.mark.parametrize("name", LLAMA_CASES)
def test_batch_of_one_is_proven(name: str) -> None:
    """The real presets run one sequence: a size-1 batch dim must not split the proof's normal forms."""
    case = load_case(EXAMPLES / name)
    case.module.CONFIG = dataclasses.replace(case.module.CONFIG, batch=1, n_layers=1)
    _assert_proven(case, 2)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "seq"), [(2, 8), (4, 8), (8, 16)])
def test_sequence_parallel_training_at_batch_of_one_is_proven(world_size: int, seq: int) -> None:
    """Megatron TP + SP training on one sequence (the preset's micro-batch): the fused qkv and
    gate_up weight gradients flatten a batch of one, a view that only drops the batch dim; at
    world size 8 each rank holds one head, of a batch of one."""
    case = load_case(EXAMPLES / "llama_sp_train.py")
    case.module.CONFIG = dataclasses.replace(case.module.CONFIG, batch=1, seq=seq, n_layers=1)
    _assert_proven(case, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_training_at_batch_of_one_is_proven(world_size: int) -> None:
    """Megatron TP training on one sequence (the 405B preset's batch) with one kv head per rank
    (as the preset at world size 8): the GQA sum of a kv head's gradient keeps its size-1 head
    dim, so the all-reduced input gradient of qkv_proj is the reference's, and so are the norm
    weights' gradients."""
    case = load_case(EXAMPLES / "llama_tp.py")
    case.module.CONFIG = dataclasses.replace(case.module.CONFIG, batch=1, seq=8, n_layers=1, n_kv_heads=world_size)
    _assert_proven(case, world_size, train=True)
