"""What each side runs and which equalities between their results are claimed.

A `Program` turns a case into two functions of plain tensors, one for the reference and one for a
rank, plus the list of `Check`s to prove on every rank. The same functions are traced on fake
tensors (capture) and run on random weights (the numeric oracle), so both judge the same claims.

Forward mode claims each model output relates to the reference output by the case's OUTPUT layout.
Training mode (`--train`) claims, for one step, that
- the loss equals the reference loss on every rank that computes one, or their mean over those
  ranks does (data parallel: each rank's loss is the mean over its own batch shard, so the claim is
  the mean of means). A user's step returning None computes no loss on that rank (a pipeline
  stage before the last); some rank must compute it;
- every rank's gradient of a parameter is built from the reference gradients exactly as that
  parameter is built from the reference parameters (by `shard_state` or the default loader).
  Ranks may hold different parameters (pipeline stages hold their layers'), but every parameter
  the reference trains is trained by some rank, and by every rank that holds it;
- with `--step`, the same for the parameters after one optimizer step. A user's step may free a
  gradient (ZeRO stage 2 keeps only its partition of the reduced flat gradient and sets `.grad` to
  None): no gradient claim is made for it, its updated parameter carries the proof.
The expected gradient is computed on the rank side by running the rank's loader on the reference
gradients, which the rank program receives as extra inputs ("bound" reference outputs). Which
claims a rank makes depends on its run (the gradients its step freed), so a rank program returns,
besides its tensors, what it `Trained`; its checks are made from that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

from shardproof.case import Case
from shardproof.errors import CaseError
from shardproof.programs import LOSS, Check
from shardproof.state import as_model_holds, local_shards, module_state, rank_inputs, rank_state

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Trained:
    """What a rank's run says about its parameters besides their values: their names, in output
    order, and those whose gradient its step freed (they carry no gradient claim)."""

    names: tuple[str, ...] = ()
    freed: frozenset[str] = frozenset()
    frozen: tuple[str, ...] = ()  # parameters the rank holds but does not train
    loss: bool = True  # whether the rank computes the loss (output 0)


class Program:
    """The forward program: the model's outputs under the case's OUTPUT layout."""

    bound: tuple[int, ...] = ()  # reference outputs each rank program receives
    refused = ""  # why the case breaks its contract, stated once the claims are made: it is unusable
    # input unless a claim that can be checked without what is missing is found failing
    unheld = ""  # a parameter the reference trains that no rank's model holds: the models are built wrong
    loads_separately = True  # `rank` is `load` then `run_loaded`: capture may trace the loader on its own
    differentiates = False  # no gradient flows through the traced program

    def __init__(self, case: Case):
        self.case = case

    def reference(self, model: torch.nn.Module, state: dict, inputs: tuple) -> Tensors:
        with torch.no_grad():  # no gradient is claimed: code that acts on grad mode takes its inference path
            return flat_tensors(functional_call(model, state, inputs))

    def rank(self, model: torch.nn.Module, ref_state: dict, inputs: tuple, rank: int, world_size: int,
             bound: Tensors) -> tuple[Tensors, Trained]:
        return self.run_loaded(model, self.load(model, ref_state, inputs, rank, world_size)), Trained()

    def load(self, model: torch.nn.Module, ref_state: dict, inputs: tuple, rank: int, world_size: int) -> Tensors:
        """The checkpoint loader alone: the rank's plain shards (in the model's state order), then its inputs."""
        shards = local_shards(self.case, ref_state, model, rank, world_size)
        return [*shards.values(), *rank_inputs(self.case, inputs, rank, world_size)]

    def run_loaded(self, model: torch.nn.Module, loaded: Tensors) -> Tensors:
        held = list(module_state(model))
        state = as_model_holds(dict(zip(held, loaded)), model)
        with torch.no_grad():
            return flat_tensors(functional_call(model, state, tuple(loaded[len(held) :])))

    def claims(self, reference_outputs: int, runs: list[tuple[int, Trained]]) -> list[Check]:
        """The claims of every rank (given each rank's output count and what it trained), each
        once, with the ranks making it when not all do."""
        return merged([self.checks(reference_outputs, outputs, trained) for outputs, trained in runs])

    def checks(self, reference_outputs: int, rank_outputs: int, trained: Trained) -> list[Check]:
        if rank_outputs != reference_outputs:
            raise CaseError(f"a rank returns {rank_outputs} tensors but the reference returns {reference_outputs}")
        layout = self.case.output_layout()
        return [Check(f"output {i}", i, i, layout) for i in range(reference_outputs)]


class TrainingProgram(Program):
    """One training step: loss, gradients and (with `step`) the updated parameters."""

    loads_separately = False  # the loader also runs on the reference gradients, inside the step
    differentiates = True

    def __init__(self, case: Case, reference_params: list[str], step: bool):
        super().__init__(case)
        if case.loss is None:
            raise CaseError("training mode needs `def loss(output, *inputs)` in the case file")
        self.names = reference_params
        self.step = step
        count = len(reference_params)
        self.bound = tuple(range(1, 1 + (2 if step else 1) * count))

    def reference(self, model: torch.nn.Module, state: dict, inputs: tuple) -> Tensors:
        params = _trainable(state, self.names)
        loss = self.case.loss(functional_call(model, replaced(state, params), inputs), *inputs)
        grads = _gradients(loss, params)
        if not self.step:
            return [loss, *grads]
        _optimizer_step(self._optimizer, params, grads)
        return [loss, *grads, *params.values()]

    def rank(self, model: torch.nn.Module, ref_state: dict, inputs: tuple, rank: int, world_size: int,
             bound: Tensors) -> tuple[Tensors, Trained]:
        local = rank_state(self.case, ref_state, model, rank, world_size)
        local_inputs = rank_inputs(self.case, inputs, rank, world_size)
        names = trainable_names(model)
        params = _trainable(local, names, dict(model.named_parameters()))
        if self.case.distributed_step is not None:
            with _reparametrize_module(model, replaced(local, params)):
                loss = self.case.distributed_step(model, local_inputs, rank, world_size)
            if loss is not None and not isinstance(loss, torch.Tensor):
                raise CaseError("distributed_step(model, inputs, rank, world_size) must return the loss tensor (or "
                                "None on a rank that computes no loss, a pipeline stage before the last)")
            freed = {n for n, p in params.items() if p.grad is None} if self.step else set()
            grads = [_grad_of(p) for p in params.values()]
        else:
            loss = self.case.loss(functional_call(model, replaced(local, params), local_inputs), *local_inputs)
            freed, grads = set(), _gradients(loss, params)
            if self.step:
                _optimizer_step(self._optimizer, params, grads)
        kept = [i for i, n in enumerate(names) if n not in freed]
        expected = self._expected(bound[: len(self.names)], ref_state, model, rank, world_size, names)
        outputs = [*([] if loss is None else [loss]), *(grads[i] for i in kept), *(expected[i] for i in kept)]
        if self.step:
            updated = self._expected(bound[len(self.names) :], ref_state, model, rank, world_size, names)
            outputs += [*params.values(), *updated]
        frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad)
        return [_local(t) for t in outputs], Trained(tuple(names), frozenset(freed), frozen, loss is not None)

    def claims(self, reference_outputs: int, runs: list[tuple[int, Trained]]) -> list[Check]:
        """Ranks may train different parameters (pipeline stages), but none may hold a parameter the
        reference trains without training it, and each the reference trains is trained somewhere
        when ranks hold parameters under the reference's names (parameters of other names, such as
        FSDP's flat chunks of several, are claimed as their loader builds them)."""
        trained_somewhere: set[str] = set()
        for rank, (_, trained) in enumerate(runs):
            untrained = [n for n in trained.frozen if n in self.names]
            if untrained:
                raise CaseError(f"rank {rank} holds `{untrained[0]}` without training it, but the reference trains "
                                "it: every rank must train the parameters the reference trains")
            trained_somewhere.update(trained.names)
        renamed = not trained_somewhere <= set(self.names)
        missing = [] if renamed else [n for n in self.names if n not in trained_somewhere]
        # what is missing cannot be claimed, but the rest can still be judged: a program whose stages are
        # assigned wrong (no rank is the last) computes it wrong, and that is a discrepancy
        if missing:
            self.unheld = missing[0]
            self.refused = f"no rank trains `{missing[0]}`, which the reference trains"
        elif not any(trained.loss for _, trained in runs):
            self.refused = "no rank returns the loss: distributed_step must return it on the ranks that compute it"
        return super().claims(reference_outputs, runs)

    def checks(self, reference_outputs: int, rank_outputs: int, trained: Trained) -> list[Check]:
        """Gradients first, then the updated parameters, then the loss: the order in which a failure
        is most useful to read (a wrong gradient trains a worse model and makes the updated parameter
        wrong too; a wrong loss alone is only mis-logged)."""
        with_grad = [n for n in trained.names if n not in trained.freed]
        start = 1 if trained.loss else 0
        checks = [Check(f"gradient of `{n}`", start + i, start + len(with_grad) + i, "rank") for i, n in enumerate(with_grad)]
        if self.step:
            count = len(trained.names)
            first = start + 2 * len(with_grad)
            checks += [Check(f"`{n}` after the optimizer step", first + i, first + count + i, "rank")
                       for i, n in enumerate(trained.names)]
        return [*checks, Check(LOSS, 0, 0, LOSS)] if trained.loss else checks

    def _optimizer(self, params: Tensors) -> torch.optim.Optimizer:
        make = self.case.optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1))
        return make(params)

    def _expected(self, values: Tensors, ref_state: dict, model: torch.nn.Module, rank: int, world_size: int,
                  names: list[str]) -> Tensors:
        """The rank's loader applied to reference values in place of the reference parameters."""
        substituted = replaced(ref_state, dict(zip(self.names, values)))
        local = rank_state(self.case, substituted, model, rank, world_size)
        return [local[name] for name in names]


def merged(per_rank: list[list[Check]]) -> list[Check]:
    """Each rank's claims, each claim once, with the ranks making it when not all do."""
    holders: dict[Check, list[int]] = {}
    for rank, checks in enumerate(per_rank):
        for check in checks:
            holders.setdefault(check, []).append(rank)
    return sorted((c if len(r) == len(per_rank) else replace(c, ranks=tuple(r)) for c, r in holders.items()),
                  key=_claim_order)


def _claim_order(check: Check) -> int:
    """Gradients, then updated parameters, then the loss (see TrainingProgram.checks); forward
    outputs in their order."""
    return 2 if check.relation == LOSS else int(check.label.endswith("after the optimizer step"))


def program_for(case: Case, reference: torch.nn.Module, mode: str) -> Program:
    """The program proven in `mode` (see case.MODES)."""
    if mode == "forward":
        return Program(case)
    return TrainingProgram(case, trainable_names(reference), step=mode == "step")


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def flat_tensors(output: Any) -> Tensors:
    """Model outputs as a flat list of plain tensors (DTensors as their local shard)."""
    if isinstance(output, torch.Tensor):
        return [_local(output)]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in flat_tensors(item)]
    raise CaseError(f"model returned {type(output).__name__}; return tensors (or a tuple/list/dict of them)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def replaced(state: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with `new`'s tensors in place of the named ones and of every other name of the same
    tensor: a tied weight (an embedding and its head) is one parameter under two names."""
    by_tensor = {id(state[name]): tensor for name, tensor in new.items() if name in state}
    return {**{name: by_tensor.get(id(tensor), tensor) for name, tensor in state.items()}, **new}


def _trainable(state: dict, names: list[str], originals: dict | None = None) -> dict[str, torch.Tensor]:
    """Fresh leaf copies that require grad, so the step never writes into the caller's tensors.
    They keep what user code attached to the model's own parameters: Python attributes (e.g.
    Megatron's `sequence_parallel` flag), which a user's step may read, and gradient hooks
    (`register_hook`, `register_post_accumulate_grad_hook`), so they fire as on the real model."""
    params = {name: state[name].detach().clone().requires_grad_() for name in names}
    for name, param in params.items():
        original = (originals or {}).get(name)
        if original is None:
            continue
        param.__dict__.update(original.__dict__)
        for hook in (original._backward_hooks or {}).values():
            param.register_hook(hook)
        for hook in (original._post_accumulate_grad_hooks or {}).values():
            param.register_post_accumulate_grad_hook(hook)
    return params


def _gradients(loss: torch.Tensor, params: dict[str, torch.Tensor]) -> Tensors:
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return [torch.zeros_like(p) if g is None else _laid_out_as(g, p) for p, g in zip(params.values(), grads)]


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter the step never reached has gradient zero (as after optimizer.zero_grad(set_to_none))."""
    return torch.zeros_like(param) if param.grad is None else _laid_out_as(param.grad, param)


def _laid_out_as(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient in its parameter's placements: DTensor's backward may leave it in others
    (an embedding's is replicated), which an optimizer step redistributes to the parameter's."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _optimizer_step(make: Callable[[Tensors], torch.optim.Optimizer], params: dict, grads: Tensors) -> None:
    for param, grad in zip(params.values(), grads):
        param.grad = grad
    make(list(params.values())).step()
