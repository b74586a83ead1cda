"""Training mode (shardproof/steps.py): loss, gradient and optimizer-step claims, proven and refuted,
each checked against the numeric oracle."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.capture.torch_capture import capture
from shardproof.case import Case
from shardproof.errors import CaseError
from shardproof.oracle import run_numeric

HIDDEN, FFN = 8, 16


class Mlp(nn.Module):
    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, ffn)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(self.norm(x))))


class _SumForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _SumBackward(torch.autograd.Function):
    """Megatron's copy to the tensor-parallel region; `reduce=False` drops the backward all-reduce."""

    @staticmethod
    def forward(ctx, x, reduce):
        ctx.reduce = reduce
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            grad = grad.clone()
            dist.all_reduce(grad)
        return grad, None


class TensorParallelMlp(Mlp):
    def __init__(self, world_size: int, reduce_input_grad: bool = True):
        super().__init__(FFN // world_size)
        self.reduce_input_grad = reduce_input_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _SumBackward.apply(self.norm(x), self.reduce_input_grad)
        return _SumForward.apply(self.down(F.silu(self.up(h))))


def _loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _inputs() -> tuple:
    return (torch.randn(8, 3, HIDDEN),)


def _tensor_parallel(reduce_input_grad: bool = True, **kw) -> Case:
    return Case(Mlp, lambda rank, n: TensorParallelMlp(n, reduce_input_grad), _inputs, loss=_loss, **kw)


def _data_parallel(average: bool) -> Case:
    def step(model, inputs, rank, world_size):
        loss = _loss(model(*inputs), *inputs)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM)
        return loss

    def batch_shard(index, full, rank, world_size):
        return full.chunk(world_size, 0)[rank]

    return Case(Mlp, lambda rank, n: Mlp(), _inputs, shard_input=batch_shard, loss=_loss, distributed_step=step)


@pytest.mark.parametrize("mode", ["train", "step"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tensor_parallel_step_is_proven(world_size: int, mode: str, checked_step) -> None:
    assert checked_step(_tensor_parallel(), world_size, mode).verdict == "equivalent"


def test_missing_backward_all_reduce_names_the_gradient_and_the_backward_op(checked_step) -> None:
    report = checked_step(_tensor_parallel(reduce_input_grad=False), 2, "train")
    assert report.verdict == "discrepancy"
    assert report.diagnosis.startswith("gradient of `norm.")
    assert "missing reduction" in report.diagnosis
    assert report.distributed[0].op.endswith("in the backward")


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_loss_is_proven_as_a_mean_over_ranks(world_size: int, checked_step) -> None:
    report = checked_step(_data_parallel(average=True), world_size, "train")
    assert report.verdict == "equivalent", report.diagnosis
    assert any("mean of the" in note and "loss" in note for note in report.notes)


@pytest.mark.parametrize("world_size", [2, 4])
def test_summed_data_parallel_gradients_are_a_wrong_reduce_op(world_size: int, checked_step) -> None:
    """Each rank's gradient is its batch shard's mean; summing them over ranks (not averaging)
    scales every gradient by the number of ranks: the all-reduce's op is named, and AVG as the fix."""
    report = checked_step(_data_parallel(average=False), world_size, "train")
    assert report.verdict == "discrepancy"
    assert report.diagnosis.startswith("gradient of `")
    assert f"wrong reduce op (x{world_size})" in report.diagnosis
    assert report.fix.startswith("reduce with ReduceOp.AVG, not ReduceOp.SUM")
    assert report.claims and all(claim.startswith("gradient of `") for claim in report.claims)


def test_training_without_a_loss_is_a_case_error() -> None:
    with pytest.raises(CaseError, match="loss"):
        verify(Case(Mlp, lambda rank, n: TensorParallelMlp(n), _inputs), world_size=2, train=True)


# --- gradients a user's step frees -------------------------------------------------------------
def _sgd_freeing_weight_grad(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """Data parallel SGD that frees the weight's gradient after the update, as ZeRO stage 2 does."""
    loss = _mse(model(*inputs), *inputs)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            p.sub_(0.1 * p.grad)
    model.weight.grad = None
    return loss


def _mse(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, x)


def _freeing_case(mode: str = "step") -> Case:
    return Case(
        reference=lambda: nn.Linear(4, 4),
        distributed=lambda rank, n: nn.Linear(4, 4),
        inputs=lambda: (torch.randn(4, 4),),
        shard_input=lambda index, full, rank, n: full.chunk(n, 0)[rank],
        loss=_mse,
        distributed_step=_sgd_freeing_weight_grad,
        mode=mode,
    )


def test_a_freed_gradient_is_claimed_through_its_updated_parameter() -> None:
    labels = [check.label for check in capture(_freeing_case(), 2, mode="step").checks]
    assert labels == ["gradient of `bias`", "`weight` after the optimizer step", "`bias` after the optimizer step", "loss"]
    assert run_numeric(_freeing_case(), 2).agree
    assert verify(_freeing_case(), world_size=2).verdict == "equivalent"


def test_without_the_step_a_missing_gradient_is_zero() -> None:
    """In training mode every gradient is claimed; one the step never produced counts as zero."""
    case = _freeing_case("train")
    labels = [check.label for check in capture(case, 2, mode="train").checks]
    assert labels == ["gradient of `weight`", "gradient of `bias`", "loss"]
    assert not run_numeric(case, 2).agree
    assert verify(case, world_size=2).verdict != "equivalent"


def _sequence_parallel_with_norm_hooks(hooked: bool) -> Case:
    """Each rank normalises its sequence shard; a grad hook registered at construction all-reduces
    the norm gradients (the model a training engine trains is this one)."""

    def build(rank: int, world_size: int) -> nn.Module:
        model = Mlp()
        for param in model.norm.parameters() if hooked else []:
            param.register_hook(_summed)
        return model

    def sequence_shard(index, full, rank, world_size):
        return full.chunk(world_size, 0)[rank]

    def step(model, inputs, rank, world_size):
        loss = _loss(model(*inputs), *inputs)  # this rank's tokens: the reference loss is the mean over ranks
        (loss / world_size).backward()
        for p in (model.up.weight, model.up.bias, model.down.weight):
            dist.all_reduce(p.grad)
        return loss

    return Case(Mlp, build, _inputs, shard_input=sequence_shard, loss=_loss, distributed_step=step)


def _summed(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


@pytest.mark.parametrize("hooked", [True, False])
def test_gradient_hooks_registered_on_the_model_fire_in_the_step(hooked: bool, checked_step) -> None:
    report = checked_step(_sequence_parallel_with_norm_hooks(hooked), 2, "train")
    assert report.verdict == ("equivalent" if hooked else "discrepancy"), report.diagnosis


def _bias_frozen_on_rank_1() -> Case:
    def build(rank: int, world_size: int) -> nn.Module:
        model = nn.Linear(4, 4)
        model.bias.requires_grad_(rank != 1)
        return model

    return Case(lambda: nn.Linear(4, 4), build, lambda: (torch.randn(4, 4),), loss=_mse, mode="train")


def test_a_rank_holding_a_parameter_the_reference_trains_must_train_it() -> None:
    """Ranks may hold different parameters (pipeline stages), but rank 1 here holds the bias and
    does not train it: it would claim no bias gradient, and its bias would never move."""
    with pytest.raises(CaseError, match="rank 1 holds `bias` without training it"):
        verify(_bias_frozen_on_rank_1(), world_size=2)
    numbers = run_numeric(_bias_frozen_on_rank_1(), 2)
    assert not numbers.agree and "rank 1 holds `bias` without training it" in numbers.detail


def _stages(drop: str | None = None, loss_on_rank_0: bool = False, returned: bool = True, scale: float = 1.0) -> Case:
    """Two pipeline stages of nn.Sequential(Linear, Tanh, Linear) (its parameters under their
    reference names): rank 0 the first layer and the tanh, rank 1 the second layer and the loss.
    `drop`: a parameter no stage holds; `returned`: whether rank 1 returns the loss; `scale`: the
    factor rank 1's backward scales the loss by."""

    def build(rank: int, world_size: int) -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        for index in ((2,) if rank == 0 else (0, 1)):
            model[index] = nn.Identity()
        if drop is not None and rank == 1:
            model[2].register_parameter(drop, None)
        return model

    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor | None:
        (x,) = inputs
        if rank == 0:
            hidden = model(x)
            dist.send(hidden.detach(), 1)
            grad = torch.empty_like(hidden)
            dist.recv(grad, 1)
            hidden.backward(grad)
            return _mse(hidden.detach(), x) if loss_on_rank_0 else None
        hidden = torch.empty_like(x)
        dist.recv(hidden, 0)
        hidden.requires_grad_()
        loss = _mse(model(hidden), x)
        (scale * loss).backward()
        dist.send(hidden.grad, 0)
        return loss if returned else None

    reference = lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))  # noqa: E731
    return Case(reference, build, lambda: (torch.randn(4, 4),), loss=_mse, distributed_step=step, mode="train")


def test_pipeline_stages_claim_the_gradients_of_the_parameters_they_hold() -> None:
    report = verify(_stages(), world_size=2)
    assert report.verdict == "equivalent", report.diagnosis
    assert "gradient of `0.weight`" in report.proven and "gradient of `2.weight`" in report.proven
    assert run_numeric(_stages(), 2).agree


def test_a_parameter_no_stage_trains_is_judged_by_the_claims_it_leaves() -> None:
    """It cannot be claimed; the other claims can: without the bias rank 1's output lacks its term,
    and the gradients computed through it are found wrong."""
    report, numbers = verify(_stages(drop="bias"), world_size=2), run_numeric(_stages(drop="bias"), 2)
    assert report.verdict == "discrepancy" and "2.bias" in report.diagnosis, report.diagnosis
    assert not numbers.agree


def test_a_loss_returned_by_a_stage_before_the_last_is_claimed_too() -> None:
    """Rank 0 returns a value that is not the loss: the loss claim is made on every rank returning one."""
    report = verify(_stages(loss_on_rank_0=True), world_size=2)
    assert report.verdict != "equivalent"
    assert not run_numeric(_stages(loss_on_rank_0=True), 2).agree


def test_a_step_returning_no_loss_is_unusable_unless_a_gradient_is_found_wrong() -> None:
    """Without a loss the gradients can still be judged: found wrong, the program is a discrepancy
    (a pipeline whose stages are assigned wrong, so that no rank is the last, computes them wrong);
    proven or not, the case breaks its contract."""
    with pytest.raises(CaseError, match="no rank returns the loss"):
        verify(_stages(returned=False), world_size=2)
    report, numbers = verify(_stages(returned=False, scale=2.0), world_size=2), run_numeric(_stages(returned=False, scale=2.0), 2)
    assert report.verdict == "discrepancy" and report.kind == "wrong scale", report.diagnosis
    assert not numbers.agree and "gradient of" in numbers.detail


class InferenceOnly(Mlp):
    """A kernel that refuses to record gradients (FlexAttention on CPU does) and a hook that can only
    be registered where they are recorded (transformers' ReplicatedWithGradAllReduce)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if y.requires_grad:
            raise NotImplementedError("this kernel does not support backward")
        return y


def test_a_forward_program_records_no_gradients() -> None:
    """Forward mode claims no gradient, so both sides run as inference does, under no_grad."""
    case = Case(InferenceOnly, lambda rank, world_size: InferenceOnly(), lambda: (torch.randn(3, HIDDEN),))
    assert verify(case, world_size=2).verdict == "equivalent"
    assert run_numeric(case, 2).agree


# --- tied weights and DTensor gradients ---------------------------------------------------------
class Tied(nn.Module):
    """Two layers sharing one weight (as an embedding and its head with `tie_word_embeddings`)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_a_tied_weight_is_one_parameter_under_both_names(checked_step) -> None:
    """The step's fresh parameter replaces the weight under its two names, so both uses reach one gradient."""
    report = checked_step(Case(Tied, lambda rank, n: Tied(), _inputs, loss=_loss), 2, "train")
    assert report.verdict == "equivalent", report.diagnosis


def _logits_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _vocab_parallel_embedding(rank: int, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"embed": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    model = nn.Sequential()
    model.embed, model.head = nn.Embedding(8, HIDDEN), nn.Linear(HIDDEN, 8, bias=False)
    return parallelize_module(model, init_device_mesh("cpu", (world_size,)), plan)


def test_a_dtensor_gradient_is_claimed_in_its_parameters_placements() -> None:
    """DTensor's embedding backward leaves a Shard(0) table's gradient replicated; the rank holds, as
    an optimizer step on the table would read it, its Shard(0) piece."""

    def reference() -> nn.Module:
        model = nn.Sequential()
        model.embed, model.head = nn.Embedding(8, HIDDEN), nn.Linear(HIDDEN, 8, bias=False)
        return model

    case = Case(reference, _vocab_parallel_embedding, lambda: (torch.arange(6).reshape(2, 3),), loss=_logits_loss)
    numbers = run_numeric(case, 2, mode="train")
    assert numbers.agree, numbers.detail
