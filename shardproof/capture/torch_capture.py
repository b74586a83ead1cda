"""Trace the reference and every rank with make_fx on fake tensors under a fake process group.

Both sides are traced as functions of the SAME leaves: the reference state dict and the reference
inputs. A rank's function builds its own state with the case's `shard_state` (or the default
loader) inside the trace, so the checkpoint slicing is part of the rank's graph and the prover
relates every rank tensor to reference tensors without being told how they are laid out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardproof.capture import custom_ops
from shardproof.capture.dispatch_trace import NotPlain, Traced, chain, record
from shardproof.capture.hints import hint, reads_a_value
from shardproof.capture.segments import Densifier
from shardproof.capture.locations import autograd_origins, every_user_frame, locator, library_frame, raised_by_shardproof, user_frame
from shardproof.capture.meshes import RealDeviceMeshes, distinct_meshes, real_shard_offsets
from shardproof.capture.symbolic_rank import group_used, symbolic_rank
from shardproof.case import Case
from shardproof.errors import CaptureError, CaseError, InternalError, ShardproofError
from shardproof.ir.decompose import OWN
from shardproof.ir.from_fx import Lowerer
from shardproof.ir.graph import BOUND_LEAF_PREFIX, Graph
from shardproof.ir.rank_expr import RankExpr
from shardproof.partition.module_calls import trace_with_memo
from shardproof.partition.rank_classes import RankClass
from shardproof.programs import Captured
from shardproof.report.progress import count
from shardproof.state import module_state
from shardproof.steps import Program, Trained, program_for

aten = torch.ops.aten


RankTracer = Callable[[list[int]], Iterator[Graph]]


def capture(
    case: Case,
    world_size: int,
    progress: Callable[[str], None] = lambda _: None,
    mode: str = "forward",
    memo: bool = True,
    placement: Callable[[float], RankTracer | None] = lambda seconds: None,
) -> Captured:
    """Trace the reference once and each rank once; every failure becomes a CaptureError.

    A rank's trace also takes the reference outputs its program is bound to (training mode: the
    reference gradients) as leaves named `reference-output:<index>`. With `memo`, a module call
    interchangeable with an earlier one is not traced again but becomes a `call` of the earlier
    one's graph (see shardproof.partition.module_calls). A program is traced for many ranks at
    once where it can be (`_RankClasses`). `placement`, given the seconds the first rank traced
    on its own took, may return a function tracing the ranks no class covers elsewhere (a worker
    pool, see shardproof.partition.backends), yielding their graphs in rank order."""
    start = time.perf_counter()
    with _session(case, world_size, mode) as session:
        reference = _trace_reference(session, memo, progress)
        bound = [_placeholder(reference, i) for i in session.program.bound]
        ranks: list[tuple[Graph, Trained]] = []
        claimed = ranks.append

        classes = _RankClasses(session, memo, bound)
        elsewhere: dict[int, Graph] = {}  # graphs of ranks traced by workers
        asked = bool(session.program.bound)  # workers trace forward programs only
        for rank in range(world_size):
            progress(f"tracing rank {rank}/{world_size}")
            graph = elsewhere.pop(rank, None)
            found = (graph, Trained()) if graph is not None else classes.graph(rank)  # workers: forward only
            if found is not None:
                claimed(found)
            else:
                traced = time.perf_counter()
                claimed(_trace_rank(session, rank, bound, memo))
                rest = None if asked else placement(time.perf_counter() - traced)
                asked = True
                if rest is not None:
                    uncovered = [r for r in range(rank + 1, world_size) if not classes.cover(r)]
                    progress(f"tracing {len(uncovered)} ranks in workers")
                    elsewhere = dict(zip(uncovered, rest(uncovered)))
            count(progress, "ranks traced", rank + 1, world_size)
        if session.reference_on_meta and session.off_meta:  # traced alike (see `_trace_reference`)
            reference = _trace_reference(session, memo, progress)
        claims = session.program.claims(len(reference.outputs), [(len(graph.outputs), trained) for graph, trained in ranks])
    return Captured(reference, [graph for graph, _ in ranks], claims, time.perf_counter() - start, session.program.refused,
                    session.program.unheld)


def capture_ranks(case: Case, world_size: int, ranks: list[int], memo: bool = True) -> list[Graph]:
    """Trace only `ranks` of a forward program (a worker's share of a capture)."""
    with _session(case, world_size, "forward") as session:
        return [_trace_rank(session, rank, [], memo)[0] for rank in ranks]


@dataclass
class _Session:
    """Fake mode's reference model, its program, and the leaves every graph is traced over."""

    case: Case
    world_size: int
    program: Program
    model: torch.nn.Module
    state_names: list[str]
    tensors: list[torch.Tensor]  # the reference's state, then its inputs
    names: list[str]
    model_on_meta: bool  # `model` was built on meta tensors (see `_reference`)
    off_meta: bool = False  # a program refused meta tensors and was traced on fake ones: the later ones are at once
    reference_on_meta: bool = False  # the reference was recorded on meta tensors

    def unpack(self, args: tuple) -> tuple[dict[str, torch.Tensor], tuple]:
        count = len(self.state_names)
        return dict(zip(self.state_names, args[:count])), tuple(args[count : len(self.tensors)])


@contextlib.contextmanager
def _session(case: Case, world_size: int, mode: str) -> Iterator[_Session]:
    # torch.compile'd code (torchtitan's FlexAttention, Megatron's fused cross entropy) is traced as
    # the eager code it compiles, by make_fx too
    with _fake_tensor_errors_unlogged(), torch.compiler.set_stance("force_eager"), \
            torch._dynamo.config.patch(error_on_nested_fx_trace=False), _attention_as_math(), \
            FakeTensorMode(allow_non_fake_inputs=True):
        with _process_group(0, 1):  # the reference is one device: rank 0 of a world of one
            ref_model, ref_state, on_meta = _reference(case)
            ref_inputs = _build("inputs()", case.inputs)
        if not isinstance(ref_inputs, (tuple, list)):
            raise CaseError(f"inputs() returned {_what(ref_inputs)}; it must return a tuple of tensors "
                            "(one input: `return (x,)`)")
        program = program_for(case, ref_model, mode)
        names = [f"state:{n}" for n in ref_state] + [f"input:{i}" for i in range(len(ref_inputs))]
        tensors = [*ref_state.values(), *ref_inputs]
        yield _Session(case, world_size, program, ref_model, list(ref_state), tensors, names, on_meta)


def _attention_as_math() -> contextlib.AbstractContextManager:
    """`scaled_dot_product_attention` by its math path (matmuls, softmax): a fused kernel would be
    one op whose backward is another, which no rule relates across a split of the heads."""
    return sdpa_kernel([SDPBackend.MATH])


@contextlib.contextmanager
def _fake_tensor_errors_unlogged() -> Iterator[None]:
    """A user's shape error surfaces as our CaptureError naming their line; torch would first log
    its whole traceback at error level (once per rank and retry), burying that message."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _reference(case: Case) -> tuple[torch.nn.Module, dict[str, torch.Tensor], bool]:
    """The reference model and its state as fake tensors: the leaves of every graph. The model is
    built on meta tensors where its state is plain, and the leaves are fake tensors of the same
    metadata and aliasing (half the cost of fake parameters; the model's own tensors are replaced
    by the leaves when it runs); see `_trace_reference` for the way back."""
    model = _meta_reference(case)
    if model is not None:
        fakes: dict[int, torch.Tensor] = {}
        return model, {name: fakes.setdefault(id(t), _fake_like(t)) for name, t in module_state(model).items()}, True
    model = _build_model("reference()", case.reference)
    return model, module_state(model), False


def _meta_reference(case: Case) -> torch.nn.Module | None:
    """The reference built on meta tensors, or None if it cannot be or holds tensor subclasses."""
    try:
        model = _build_model("reference()", lambda: _on_meta(case.reference))
    except (ShardproofError, InternalError):
        return None
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in module_state(model).values())
    return model if plain else None


def _fake_like(tensor: torch.Tensor) -> torch.Tensor:
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    return fake.requires_grad_(tensor.requires_grad)


def _trace_reference(session: _Session, memo: bool, progress: Callable[[str], None]) -> Graph:
    """The reference's graph; a model built on meta tensors is recorded by the light tracer alone,
    and built again on fake tensors where that fails, or, traced again once the ranks are, where a
    rank was traced on fake tensors: code reading its tensors' device takes another branch on meta
    tensors than on the CPU the ranks' fake tensors report (transformers' MoE counts tokens per
    expert by dtype per device)."""
    progress("tracing reference")

    def trace(model: torch.nn.Module, light_only: bool, on_meta: bool = True) -> Graph:
        def run_reference(*args: torch.Tensor) -> list[torch.Tensor]:
            return session.program.reference(model, *session.unpack(args))

        return _trace("the reference model", run_reference, session.tensors, session.names, [], None,
                      model if memo else None, session.program, light_only=light_only, on_meta=on_meta)

    with _process_group(0, 1):  # as it was built
        if not session.model_on_meta:
            return trace(session.model, light_only=False)
        if session.off_meta:
            try:
                return trace(_build_model("reference()", session.case.reference), light_only=False, on_meta=False)
            except (ShardproofError, InternalError, NotPlain):
                pass  # a program that runs on meta tensors only as the model built on them holds its state (ties)
        try:
            graph = trace(session.model, light_only=True)
            session.reference_on_meta = True
            return graph
        except (ShardproofError, InternalError, NotPlain):
            model = _build_model("reference()", session.case.reference)
            graph = trace(model, light_only=False)
            session.off_meta = True  # the ranks' programs will refuse them too
            return graph


def _trace_rank(session: _Session, rank: int, bound: list[torch.Tensor], memo: bool) -> tuple[Graph, Trained]:
    """The rank's graph (its checkpoint loader, then its model, over the reference's leaves) and what
    its run says about its parameters.

    A program first tries its model built on meta tensors, recorded by the light tracer only: fake
    tensors cost ~6x more to make, and a 126-layer model makes ~800 parameters per rank. That
    model's own tensors are replaced by the loaded ones, so the graph is the same; where it is not
    usable as it is (a tensor constant without a value, code that needs fake tensors, tensor
    subclasses), the model is built again on fake tensors and traced as always; once a program
    needed that (the reference or a rank), the later ones are built on fake tensors at once: the
    same code, the same failure."""
    with _process_group(rank, session.world_size):
        if not session.off_meta:
            try:
                return _trace_program(session, rank, bound, memo, on_meta=True)
            except (ShardproofError, InternalError, NotPlain):
                session.off_meta = True
        try:
            return _trace_program(session, rank, bound, memo, on_meta=False)
        except CaptureError as err:
            if not reads_a_value(err):
                raise
            try:
                return _trace_reading_values(session, rank, bound)
            except NoFixedShape as why:
                raise CaptureError(f"{err}\n  {why}") from err
            except Exception:  # noqa: BLE001 - read as values, it still stops: at the first read, as it was
                raise err from None


def _trace_reading_values(session: _Session, rank: int, bound: list[torch.Tensor]) -> tuple[Graph, Trained]:
    """A rank's program that reads split sizes off its tensors (`.tolist()`), traced by make_fx
    with the values read as unbacked sizes, then rewritten in fixed-shape form (`segments.py`),
    which refuses at its line whatever it cannot rewrite. Its own fake mode, whose shape
    environment makes the sizes (the leaves are made anew in it: only their shapes matter)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    with mode, torch._dynamo.config.patch(capture_scalar_outputs=True):
        leaves = [_made_in_mode(t) for t in session.tensors]
        anew = dataclasses.replace(session, tensors=leaves)
        return _trace_program(anew, rank, [_made_in_mode(t) for t in bound], False, on_meta=False, reading_values=True)


def _made_in_mode(tensor: torch.Tensor) -> torch.Tensor:
    made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    return made.requires_grad_(tensor.requires_grad)


def _trace_program(
    session: _Session, rank: int, bound: list[torch.Tensor], memo: bool, on_meta: bool, symbol: RankExpr | None = None,
    light_only: bool | None = None, reading_values: bool = False,
) -> tuple[Graph, Trained]:
    """A rank's program and what its run says about its parameters. `on_meta`: the model built on
    meta tensors and the program recorded by the light tracer alone (any failure raises);
    otherwise the model is built on fake tensors and recorded on them, never tried on meta tensors
    first: a failed run may have left the model half-changed (FSDP's lazy init refuses meta
    parameters after it began), and make_fx then traces that same model. `light_only` (default:
    `on_meta`): no make_fx where the light tracer cannot record. With `symbol`, the program is
    given that for its rank (see `_rank_class`).

    A program that loads separately is traced as its loader, then its model; otherwise (a training
    step: the loader, the step, the loader again over the reference gradients) as one function of
    the reference's leaves and `bound`."""
    program, world_size = session.program, session.world_size
    given = rank if symbol is None else symbol
    light_only = on_meta if light_only is None else light_only

    def build() -> torch.nn.Module:
        return session.case.distributed(given, world_size)

    model = _build_model(f"distributed({rank}, {world_size})", (lambda: _on_meta(build)) if on_meta else build)
    held = model if memo else None
    if program.loads_separately:

        def load(*args: torch.Tensor) -> list[torch.Tensor]:
            return program.load(model, *session.unpack(args), given, world_size)

        def run_loaded(*loaded: torch.Tensor) -> list[torch.Tensor]:
            return program.run_loaded(model, list(loaded))

        with _recorded_reduce_ops() as reduce_ops:
            return _trace(f"rank {rank}", run_loaded, session.tensors, session.names, reduce_ops, rank, held,
                          program, load, light_only=light_only, on_meta=on_meta, reading_values=reading_values), Trained()
    runs: list[Trained] = []  # tracers keep tensors only: the rest of a run's result is kept here

    def run_rank(*args: torch.Tensor) -> list[torch.Tensor]:
        outputs, trained = program.rank(model, *session.unpack(args), given, world_size, list(args[len(session.tensors) :]))
        runs.append(trained)
        return outputs

    names = session.names + [f"{BOUND_LEAF_PREFIX}{i}" for i in program.bound]
    with _recorded_reduce_ops() as reduce_ops:
        traced = _trace(f"rank {rank}", run_rank, session.tensors + bound, names, reduce_ops, rank, held, program,
                        light_only=light_only, on_meta=on_meta, reading_values=reading_values)
    return traced, runs[-1]


class _RankClasses:
    """The rank classes found so far (see partition/rank_classes); tracing symbolically stops once
    it stops paying: it failed, or two classes held only their own rank."""

    def __init__(self, session: _Session, memo: bool, bound: list[torch.Tensor]):
        self.session, self.memo, self.bound = session, memo, bound
        self.found: list[tuple[RankClass, Trained]] = []  # a class, and what each of its ranks' runs says
        self.singletons = 0
        self.trying = True

    def cover(self, rank: int) -> tuple[RankClass, Trained] | None:
        """The class found so far that covers the rank."""
        return next((known for known in self.found if known[0].covers(rank)), None)

    def graph(self, rank: int) -> tuple[Graph, Trained] | None:
        """The rank's graph from a class, None if it must be traced as it is."""
        known = self.cover(rank) or self._found(rank)
        return None if known is None else (known[0].at(rank), known[1])

    def _found(self, rank: int) -> tuple[RankClass, Trained] | None:
        if not self.trying:
            return None
        found = _rank_class(self.session, rank, self.memo, self.bound)
        if found is None:
            self.trying = False
            return None
        if not found[0].covers(rank):
            raise AssertionError(f"the symbolic trace of rank {rank} does not hold at rank {rank}")
        self.found.append(found)
        world = range(rank + 1, self.session.world_size)
        self.singletons += not any(found[0].covers(r) for r in world)
        self.trying = self.singletons < 2
        return found


def _rank_class(session: _Session, rank: int, memo: bool, bound: list[torch.Tensor]) -> tuple[RankClass, Trained] | None:
    """The rank's program traced with its rank symbolic: one trace for every rank its guards
    admit (where they hold, the program runs exactly as traced: what its run says about its
    parameters too). By the light tracer alone, on meta tensors, or on fake ones where the program
    needs them (FlexAttention refuses meta tensors), as `_trace_rank` would trace it. None where
    that cannot be done (tensor subclasses, code that fails on a symbolic rank, a reference not
    built on meta tensors); the rank is then traced as it is."""
    if not session.model_on_meta:
        return None
    for on_meta in (True, False) if not session.off_meta else (False,):
        with _process_group(rank, session.world_size), symbolic_rank(rank, session.world_size) as (symbol, guards):
            try:
                graph, trained = _trace_program(session, rank, bound, memo, on_meta, symbol, light_only=True)
            except NotPlain:
                return None
            except (ShardproofError, InternalError):
                continue
        session.off_meta |= not on_meta
        return RankClass(graph, frozenset(guards)), trained
    return None


def _on_meta(build: Callable[[], Any]) -> Any:
    """`build()` with factory functions making meta tensors, outside fake mode."""
    with unset_fake_temporarily(), torch.device("meta"):
        return build()


# Composite backward and optimizer ops, broken into the primitive ops the rules know.
_DECOMPOSED = get_decompositions([
    aten.silu_backward, aten.gelu_backward, aten.sigmoid_backward, aten.tanh_backward, aten.threshold_backward,
    aten.native_layer_norm_backward, aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.native_dropout_backward, aten.lerp, aten.lerp_, aten.addcmul,
    aten.addcmul_, aten.addcdiv, aten.addcdiv_, aten.mse_loss, aten.mse_loss_backward, aten.nll_loss_forward,
    aten.nll_loss_backward,
])


def _decompositions() -> dict:
    """What is traced as smaller ops: the table above, our own decompositions (`ir/decompose.OWN`)
    and Python custom ops (`capture/custom_ops`)."""
    return {**_DECOMPOSED, **OWN, **custom_ops.implementations()}


def _trace(
    what: str,
    fn: Callable,
    leaves: list,
    leaf_names: list[str],
    reduce_ops: list[str],
    rank: int | None,
    model: torch.nn.Module | None,
    program: Program,
    loader: Callable | None = None,
    light_only: bool = False,
    on_meta: bool = True,
    reading_values: bool = False,
) -> Graph:
    """Trace `fn` (after `loader`, which maps the leaves to `fn`'s arguments) into IR; with `model`,
    its repeated submodules' calls are traced once. A program (a training step too: autograd's
    backward runs on this thread, under the tracer's mode) is recorded whole by the light tracer
    where it handles plain tensors only; otherwise the loader is, where it can be, and make_fx
    traces the rest. `light_only`: no make_fx. `on_meta`: the light tracer may record on meta
    tensors (see `dispatch_trace.record`). `reading_values`: make_fx alone, the values the program
    reads traced as unbacked sizes and the graph rewritten in fixed-shape form (`segments.py`)."""

    def trace(restart: Callable[[], None]) -> Traced | fx.GraphModule:
        whole = fn if loader is None else _after(loader, fn)
        if reading_values:
            return _trace_fx(what, whole, leaves)
        gm = _recorded(what, whole, leaves, _give_up if light_only else restart, on_meta)
        return gm or _loaded_then_fx(what, fn, leaves, loader)

    def lower(gm: Traced | fx.GraphModule, names: list[str], ops: list[str]) -> Graph:
        if reading_values:
            Densifier(gm.graph, rank, dist.get_world_size(), _refusal(gm)).run()
        _drop_unread(gm.graph)
        return Lowerer(gm, names, locator(gm), ops, _group_ranks, rank).run()

    return trace_with_memo(model, reduce_ops, trace, leaf_names, lower, program.differentiates, _decompositions())


class NoFixedShape(CaptureError):
    """The values read have no fixed-shape form (`segments.py`) at an op."""


def _refusal(gm: fx.GraphModule) -> Callable[[fx.Node, str], NoFixedShape]:
    """An error at a node's line, saying what the rewriting would need there."""
    locate = locator(gm)

    def refuse(node: fx.Node, needs: str) -> NoFixedShape:
        where = locate(node)
        at = f" at {where.file}:{where.line}  {where.code}" if where is not None else ""
        return NoFixedShape(f"traced with the values read as sizes, `{node.target}`{at} has no fixed-shape form: it needs {needs}")

    return refuse


def _drop_unread(graph: fx.Graph) -> None:
    """Remove what computes, from tensor constants alone, values nothing reads: the detach each of
    a model's own tensors gets from a `state_dict()` call in a checkpoint loader, say. Those
    tensors are constants to a tracer, some without a value (the model built on meta tensors),
    and they take no part in what the program computes."""
    for node in reversed(graph.nodes):
        if node.users:
            continue
        if node.op == "get_attr" or node.op == "call_function" and _of_constants_only(node):
            graph.erase_node(node)


def _of_constants_only(node: fx.Node) -> bool:
    """An op writing none of its arguments whose tensor inputs are all tensor constants."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    inputs = node.all_input_nodes
    return bool(inputs) and all(n.op == "get_attr" for n in inputs)


def _give_up() -> None:
    raise CaptureError("the light tracer alone cannot trace this program")


def _loaded_then_fx(what: str, fn: Callable, leaves: list, loader: Callable | None) -> Traced | fx.GraphModule:
    """`fn` traced with make_fx, after `loader` recorded by the light tracer where it can be."""
    if loader is None:
        return _trace_fx(what, fn, leaves)
    try:
        loaded, arguments = _failing_as_capture_error(f"tracing {what}", lambda: record(loader, leaves))
    except NotPlain:  # a loader handling DTensors: traced with make_fx, as part of `fn`
        return _trace_fx(what, _after(loader, fn), leaves)
    return chain(loaded, _trace_fx(what, fn, arguments))


def _recorded(what: str, fn: Callable, leaves: list, restart: Callable[[], None], on_meta: bool) -> Traced | None:
    """A program by the light tracer (~10x cheaper per op than make_fx: a 126-layer model's
    calls and loader, twice per training step, dominated capture); None where it handles tensor
    subclasses, after `restart`: make_fx traces those."""
    try:
        return _failing_as_capture_error(f"tracing {what}", lambda: record(fn, leaves, restart, _decompositions(), on_meta=on_meta)[0])
    except NotPlain:
        restart()
        return None


def _trace_fx(what: str, fn: Callable, leaves: list) -> fx.GraphModule:
    def run() -> fx.GraphModule:
        with autograd_origins(), every_user_frame():
            return make_fx(fn, decomposition_table=_decompositions(), tracing_mode="real", record_stack_traces=True)(*leaves)

    return _failing_as_capture_error(f"tracing {what}", run)


def _after(first: Callable, then: Callable) -> Callable:
    return lambda *args: then(*first(*args))


def _failing_as_capture_error(what: str, run: Callable[[], Any]) -> Any:
    """`run()`; a failure of the user's code becomes a CaptureError "<what> failed" with the user's
    frame, one of shardproof's own an InternalError saying where."""
    try:
        return run()
    except (ShardproofError, InternalError, NotPlain):
        raise
    except Exception as err:  # noqa: BLE001 - every failure is either the user's or ours
        ours = raised_by_shardproof(err)
        if ours is not None:
            raise InternalError(f"{what} failed in shardproof ({ours}): {type(err).__name__}: {_first_line(err)}") from err
        advice = hint(err)
        inside = library_frame(err) if advice else ""
        raise CaptureError(f"{what} failed: {type(err).__name__}: {_first_line(err)}{user_frame(err)}{inside}{advice}") from err


def _placeholder(reference: Graph, output_index: int) -> torch.Tensor:
    """A fake tensor shaped like one of the reference's outputs."""
    node = reference[reference.outputs[output_index]]
    return torch.empty(node.shape, dtype=getattr(torch, node.dtype))


def _build(what: str, fn: Callable[[], Any]) -> Any:
    def build() -> Any:
        with RealDeviceMeshes():
            return fn()

    return _failing_as_capture_error(what, build)


def _build_model(what: str, fn: Callable[[], Any]) -> torch.nn.Module:
    model = _build(what, fn)
    if not isinstance(model, torch.nn.Module):
        raise CaseError(f"{what} returned {_what(model)}; it must return the model (a torch.nn.Module)")
    return model


def _what(value: Any) -> str:
    """A value as the user would name it: None, a tensor (fake or not), a dict."""
    return "None" if value is None else "a tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


@contextlib.contextmanager
def _process_group(rank: int, world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with distinct_meshes(), real_shard_offsets():
            yield
    finally:
        dist.destroy_process_group()


# c10d functions taking a ReduceOp (torch 2.13 spells reduce_scatter_tensor reduce_scatter_single).
_REDUCING_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter")


@contextlib.contextmanager
def _recorded_reduce_ops() -> Iterator[list[str]]:
    """In-place c10d collectives hide their ReduceOp in an opaque object: note it at call time."""
    recorded: list[str] = []
    originals = {name: getattr(dist, name) for name in _REDUCING_COLLECTIVES}

    def wrap(name: str) -> Callable:
        original = originals[name]
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            op = signature.bind(*args, **kwargs).arguments.get("op", dist.ReduceOp.SUM)
            recorded.append(_reduce_name(op))
            return original(*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield recorded
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _reduce_name(op: Any) -> str:
    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
    for key, name in names.items():
        if op == key:
            return name
    return "unsupported"


def _group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group given as a torchbind object or a group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        pg = _resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):
        pg = dist.ProcessGroup.unbox(group)
    else:
        pg = group
    ranks = tuple(dist.get_process_group_ranks(pg))
    group_used(ranks)
    return ranks


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""
