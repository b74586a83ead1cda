"""Megatron-Core 0.16's own tensor and sequence parallelism on a tiny GPTModel (its column- and
row-parallel linears, vocab-parallel embedding, vocab-parallel cross entropy, finalize_model_grads,
its checkpoint layout read from its sharded state dict), forward and in training; and bugs injected
into its code, each found at the line that carries it, each fixed twin proven."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install 'shardproof[megatron]'")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core.fusions import fused_cross_entropy  # noqa: E402
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding  # noqa: E402
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region  # noqa: E402

from shardproof import verify  # noqa: E402
from shardproof.integrations import megatron  # noqa: E402
from shardproof.integrations.megatron import megatron_gpt_case, tiny_config  # noqa: E402
from shardproof.oracle import run_numeric  # noqa: E402

VOCAB, WORLD = 32, 2
THIS = Path(__file__).name
RUNS = [(mode, n) for mode, sizes in (("forward", (2, 4, 8)), ("train", (2, 4))) for n in sizes]
SLOW = {("forward", 8), ("train", 2), ("train", 4)}


@pytest.mark.parametrize("sequence_parallel, mode, world_size", [
    pytest.param(sp, mode, n, marks=[pytest.mark.slow] if (mode, n) in SLOW else [], id=f"{'sp' if sp else 'tp'}-{mode}-{n}")
    for sp in (False, True) for mode, n in RUNS
])
def test_megatron_gpt_computes_the_reference(sequence_parallel: bool, mode: str, world_size: int) -> None:
    case = megatron_gpt_case(tiny_config(sequence_parallel=sequence_parallel), VOCAB, world_size, mode=mode)
    numbers = run_numeric(case, world_size, mode=mode)
    assert numbers.agree, numbers.detail
    report = verify(case, world_size=world_size)
    assert report.verdict == "equivalent", report.diagnosis


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["forward", "train"])
def test_megatron_gpt_with_one_head_per_rank(mode: str) -> None:
    """8 heads at TP 8: each rank's attention merges its one head with the batch, (s, b, 1, d) ->
    (s, b, d), where the reference merges all heads, (s, b, 8, d) -> (s, b*8, d)."""
    config = dataclasses.replace(tiny_config(layers=1), num_attention_heads=8, num_query_groups=8)
    case = megatron_gpt_case(config, VOCAB, 8, mode=mode)
    numbers = run_numeric(case, 8, mode=mode)
    assert numbers.agree, numbers.detail
    report = verify(case, world_size=8)
    assert report.verdict == "equivalent", report.diagnosis


# --- injected bugs ---------------------------------------------------------------------------------


def _embedding_forward(last_row_masked: bool) -> Callable:
    """VocabParallelEmbedding.forward (tensor_parallel/layers.py), TP without SP; its mask's upper
    bound one lower when `last_row_masked`."""

    def forward(self: VocabParallelEmbedding, input_: torch.Tensor) -> torch.Tensor:
        end = self.vocab_end_index - (1 if last_row_masked else 0)
        input_mask = (input_ < self.vocab_start_index) | (input_ >= end)  # BUG(overlapping shards) if last_row_masked
        masked_input = input_.clone() - self.vocab_start_index
        masked_input[input_mask] = 0
        output_parallel = F.embedding(masked_input, self.weight)
        output_parallel[input_mask, :] = 0.0
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    return forward


def _cross_entropy_forward(reduce_max: bool) -> Callable:
    """The native fused vocab-parallel cross entropy's forward (fusions/fused_cross_entropy.py);
    without its MAX all-reduce unless `reduce_max`: each rank shifts its logits by its own max."""

    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group: Any) -> torch.Tensor:
        vocab_parallel_logits, logits_max = fused_cross_entropy.calculate_logits_max(vocab_parallel_logits)
        if reduce_max:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        start, end = fused_cross_entropy.VocabUtility.vocab_range_from_per_partition_vocab_size(
            vocab_parallel_logits.size()[-1], tp_group.rank(), tp_group.size())
        target_mask, masked_target_1d, predicted_and_sum, exp_logits = fused_cross_entropy.calculate_predicted_logits(
            vocab_parallel_logits, target, logits_max, start, end)
        torch.distributed.all_reduce(predicted_and_sum, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        exp_logits, loss = fused_cross_entropy.calculate_cross_entropy_loss(exp_logits, predicted_and_sum)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    return staticmethod(forward)


def _finalize(runs: bool) -> Callable:
    """finalize_model_grads as the step calls it, or a step that forgets to call it."""
    original = megatron.finalize_model_grads

    def finalize(model: list, pg_collection: Any = None) -> None:
        if runs:
            original(model, pg_collection=pg_collection)

    return finalize


def _norm_flag(kept: bool) -> Callable:
    """GPTRun built with one pre-MLP norm's weight losing its `sequence_parallel` flag unless `kept`
    (TransformerEngine #1528, Megatron #1446): finalize_model_grads then skips its gradient."""
    original = megatron.GPTRun.__init__

    def init(self: megatron.GPTRun, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not kept:
            self.module.decoder.layers[1].pre_mlp_layernorm.weight.sequence_parallel = False

    return init


# (name, mode, sequence parallel, (owner, attribute, buggy, fixed), kind, the culprit's file and code)
BUGS = [
    ("embedding-mask-off-by-one", "forward", False,
     (VocabParallelEmbedding, "forward", _embedding_forward(True), _embedding_forward(False)),
     "overlapping shards", (THIS, "input_mask = (input_ < self.vocab_start_index)")),
    ("cross-entropy-local-max", "train", False,
     (fused_cross_entropy._VocabParallelCrossEntropy, "forward", _cross_entropy_forward(False), _cross_entropy_forward(True)),
     "missing reduction", ("cross_entropy.py", "logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]")),
    ("finalize-grads-not-called", "train", True, (megatron, "finalize_model_grads", _finalize(False), _finalize(True)),
     "missing reduction", ("transformer_layer.py", "self.input_layernorm(hidden_states)")),
    ("sp-norm-flag-lost", "train", True, (megatron.GPTRun, "__init__", _norm_flag(False), _norm_flag(True)),
     "missing reduction", ("transformer_layer.py", "self.pre_mlp_layernorm(hidden_states)")),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, mode, sequence_parallel, patch, kind, culprit", BUGS, ids=[b[0] for b in BUGS])
def test_an_injected_bug_is_found_at_its_line_and_its_twin_proven(name, mode, sequence_parallel, patch, kind, culprit,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    owner, attr, buggy, fixed = patch
    case = megatron_gpt_case(tiny_config(sequence_parallel=sequence_parallel), VOCAB, WORLD, mode=mode)
    monkeypatch.setattr(owner, attr, buggy)
    report = verify(case, world_size=WORLD)
    assert report.exit_code == 1 and kind in report.diagnosis, report.diagnosis
    first = report.distributed[0]
    assert (Path(first.file).name, culprit[1] in first.code) == (culprit[0], True), first
    assert not run_numeric(case, WORLD, mode=mode).agree
    monkeypatch.setattr(owner, attr, fixed)
    assert verify(case, world_size=WORLD).exit_code == 0
    assert run_numeric(case, WORLD, mode=mode).agree
