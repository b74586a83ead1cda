"""Bugs injected into torchtitan's own code and plans, each a discrepancy of its kind at the line
that carries it (in torchtitan, or in the patched function below that stands for its code), and
each fixed twin proven equivalent. The numeric oracle agrees with every verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("torchtitan", reason="needs the titan extra: pip install 'shardproof[titan]'")

import spmd_types as spmd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchtitan.distributed.spmd_types as spmd_helpers  # noqa: E402
from torchtitan.models.common.decoder_sharding import norm_config, rowwise_config  # noqa: E402
from torchtitan.models.common.embedding import Embedding  # noqa: E402
from torchtitan.protocols.sharding import ShardingConfig  # noqa: E402

from shardproof import verify  # noqa: E402
from shardproof.integrations.torchtitan import tiny_config, torchtitan_case  # noqa: E402
from shardproof.oracle import run_numeric  # noqa: E402

WORLD = 2
THIS = Path(__file__).name


def _embedding_forward(upper: int) -> Callable:
    """torchtitan's `Embedding.forward` (models/common/embedding.py), its mask's upper bound
    shifted by `upper`: 1 is the off-by-one `<=`."""

    def forward(self: Embedding, input: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(input, self.weight)
        chunk_size = (self.num_embeddings + dist.get_world_size(self.tp_group) - 1) // dist.get_world_size(self.tp_group)
        offset = dist.get_rank(self.tp_group) * chunk_size
        mask = (input >= offset) & (input < offset + self.weight.shape[0] + upper)  # BUG(overlapping shards) if upper
        local_input = (input - offset).clamp(0, self.weight.shape[0] - 1)
        out = F.embedding(local_input, self.weight)
        return out * mask.unsqueeze(-1).to(out.dtype)

    return forward


def _distribute(every_rank_shard_0: bool) -> Callable:
    """torchtitan's `spmd_distribute_tensor` (distributed/spmd_types.py) for one-axis layouts, its
    chunk index patched to 0 on every rank when `every_rank_shard_0` (the loader never told the rank)."""

    def spmd_distribute_tensor(tensor: torch.Tensor, mesh: Any, layout: Any) -> torch.Tensor:
        for axis_name, axis_type in layout.per_axis_spmd_types().items():
            axis = axis_name.value
            size = mesh.size(mesh.mesh_dim_names.index(axis)) if axis in mesh.mesh_dim_names else 1
            if isinstance(axis_type, spmd.Shard) and size > 1:
                rank = 0 if every_rank_shard_0 else dist.get_rank(mesh.get_group(axis))
                tensor = torch.chunk(tensor, size, dim=axis_type.dim)[rank]  # BUG(overlapping shards) if shard 0
        return tensor

    return spmd_distribute_tensor


def _wo_without_its_reduction(config: Any) -> None:
    """One layer's `attention.wo` plan keeps its partial output (no out_dst: no all-reduce)."""
    wo = rowwise_config()
    config.layers[1].attention.wo.sharding_config = ShardingConfig(
        state_shardings=wo.state_shardings, out_src_shardings=wo.out_src_shardings)


def _norm_left_out_of_sp(config: Any) -> None:
    """One layer's `ffn_norm` planned as without sequence parallelism in an SP model: its weight is
    typed I (invariant), so nothing reduces its gradient, a partial sum over the ranks' tokens."""
    config.layers[1].ffn_norm.sharding_config = norm_config(enable_sp=False)


# (name, mode, sequence parallel, config change, patches, kind, the culprit's file and code)
BUGS = [
    ("embedding-mask-off-by-one", "forward", False, None, [(Embedding, "forward", _embedding_forward(1))],
     "overlapping shards", (THIS, "mask = (input >= offset)")),
    ("loader-every-rank-shard-0", "forward", False, None,
     [(spmd_helpers, "spmd_distribute_tensor", _distribute(every_rank_shard_0=True))],
     "overlapping shards", (THIS, "tensor = torch.chunk(tensor, size, dim=axis_type.dim)[rank]")),
    ("wo-reduction-dropped", "forward", False, _wo_without_its_reduction, [],
     "missing reduction", ("attention.py", "return self.wo(out_BLD)")),
    ("sp-norm-grad-unreduced", "train", True, _norm_left_out_of_sp, [],
     "missing reduction", ("model.py", "self.ffn_norm(")),
]
FIXED_PATCHES = {
    "embedding-mask-off-by-one": [(Embedding, "forward", _embedding_forward(0))],
    "loader-every-rank-shard-0": [(spmd_helpers, "spmd_distribute_tensor", _distribute(every_rank_shard_0=False))],
}


def _case(model: str, mode: str, sequence_parallel: bool, change: Callable | None) -> Any:
    config = tiny_config(model, sequence_parallel=sequence_parallel, attention="flex" if mode == "forward" else "sdpa")
    if change is not None:
        change(config)
    return torchtitan_case(config, WORLD, mode=mode)


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
@pytest.mark.parametrize("name, mode, sequence_parallel, change, patches, kind, culprit", BUGS, ids=[b[0] for b in BUGS])
def test_an_injected_bug_is_found_at_its_line(name, mode, sequence_parallel, change, patches, kind, culprit, model,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for owner, attr, value in patches:
        monkeypatch.setattr(owner, attr, value)
    case = _case(model, mode, sequence_parallel, change)
    report = verify(case, world_size=WORLD)
    assert report.exit_code == 1 and kind in report.diagnosis, report.diagnosis
    first = report.distributed[0]
    assert (Path(first.file).name, culprit[1] in first.code) == (culprit[0], True), first
    assert not run_numeric(case, WORLD, mode=mode).agree


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
@pytest.mark.parametrize("name, mode, sequence_parallel", [b[:3] for b in BUGS], ids=[b[0] for b in BUGS])
def test_the_fixed_twin_is_proven(name, mode, sequence_parallel, model, monkeypatch: pytest.MonkeyPatch) -> None:
    for owner, attr, value in FIXED_PATCHES.get(name, []):
        monkeypatch.setattr(owner, attr, value)
    case = _case(model, mode, sequence_parallel, None)
    assert verify(case, world_size=WORLD).exit_code == 0
    assert run_numeric(case, WORLD, mode=mode).agree
