"""Every HLO lowering, run numerically: the IR it emits, executed with the ops' torch
implementations, must compute what the HLO instruction means (written here in torch)."""

from __future__ import annotations

import re

import pytest
import torch

from shardproof.errors import GraphFileError, UnsupportedOp
from shardproof.importers.hlo import lower_hlo, world_size_of
from shardproof.importers.hlo_text import parse_hlo
from shardproof.ir.run import run_graph, run_ranks

REDUCERS = """
%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

%mul_f32 (a: f32[3], b: f32[3]) -> f32[3] {
  %a = f32[3] parameter(0)
  %b = f32[3] parameter(1)
  ROOT %c = f32[3] multiply(%a, %b)
}

%max_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] maximum(%a, %b)
}
"""


def hlo(params: dict[str, str], body: list[str]) -> str:
    """A module whose ENTRY takes `params` (name -> type) and runs `body` (last line is ROOT)."""
    lines = [f"  %{name} = {ty} parameter({i})" for i, (name, ty) in enumerate(params.items())]
    lines += [f"  {line}" for line in body[:-1]] + [f"  ROOT {body[-1]}"]
    signature = ", ".join(f"{n}: {t}" for n, t in params.items())
    result = re.match(r"%\S+ = (\([^)]*\)|\S+)", body[-1]).group(1)  # the ROOT's declared type
    return f"HloModule test\n{REDUCERS}\nENTRY %main ({signature}) -> {result} {{\n" + "\n".join(lines) + "\n}\n"


def run(text: str, **inputs: torch.Tensor) -> list[torch.Tensor]:
    imported = lower_hlo(parse_hlo(text, "t.hlo"), None, 1)
    return run_graph(imported.graph, {i.name: inputs[i.name] for i in imported.inputs})


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


CASES = {
    "dot with batch and multiple free dims": (
        {"x": "f32[2,3,4,5]", "y": "f32[5,2,6]"},
        ["%d = f32[2,3,4,6] dot(%x, %y), lhs_batch_dims={0}, lhs_contracting_dims={3}, rhs_batch_dims={1}, rhs_contracting_dims={0}"],
        lambda x, y: torch.einsum("bijk,kbn->bijn", x, y),
    ),
    "dot contracting the leading dims": (
        {"x": "f32[4,3]", "y": "f32[4,5]"},
        ["%d = f32[3,5] dot(%x, %y), lhs_contracting_dims={0}, rhs_contracting_dims={0}"],
        lambda x, y: x.T @ y,
    ),
    "broadcast into inner dims, transposed": (
        {"x": "f32[3,2]"},
        ["%b = f32[2,4,3] broadcast(%x), dimensions={2,0}"],
        lambda x: x.T[:, None, :].expand(2, 4, 3),
    ),
    "transpose, reshape, slice, concatenate": (
        {"x": "f32[2,3,4]"},
        [
            "%t = f32[4,2,3] transpose(%x), dimensions={2,0,1}",
            "%r = f32[8,3] reshape(%t)",
            "%s = f32[3,2] slice(%r), slice={[2:5], [1:3]}",
            "%c = f32[3,6] concatenate(%s, %s, %s), dimensions={1}",
        ],
        lambda x: torch.cat([x.permute(2, 0, 1).reshape(8, 3)[2:5, 1:3]] * 3, 1),
    ),
    "softmax spelled with reduce max and add": (
        {"x": "f32[3,5]"},
        [
            "%ninf = f32[] constant(-inf)",
            "%m = f32[3] reduce(%x, %ninf), dimensions={1}, to_apply=%max_f32",
            "%mb = f32[3,5] broadcast(%m), dimensions={0}",
            "%d = f32[3,5] subtract(%x, %mb)",
            "%e = f32[3,5] exponential(%d)",
            "%zero = f32[] constant(0)",
            "%s = f32[3] reduce(%e, %zero), dimensions={1}, to_apply=%add_f32",
            "%sb = f32[3,5] broadcast(%s), dimensions={0}",
            "%p = f32[3,5] divide(%e, %sb)",
        ],
        lambda x: torch.softmax(x, 1),
    ),
    "reduce with a non-neutral initial value": (
        {"x": "f32[3,5]"},
        ["%one = f32[] constant(1.5)", "%s = f32[5] reduce(%x, %one), dimensions={0}, to_apply=%add_f32"],
        lambda x: x.sum(0) + 1.5,
    ),
    "causal mask from iota, compare and select": (
        {"x": "f32[4,4]"},
        [
            "%i = s32[4,4] iota(), iota_dimension=0",
            "%j = s32[4,4] iota(), iota_dimension=1",
            "%le = pred[4,4] compare(%j, %i), direction=LE",
            "%big = f32[] constant(-30000)",
            "%fill = f32[4,4] broadcast(%big), dimensions={}",
            "%s = f32[4,4] select(%le, %x, %fill)",
        ],
        lambda x: torch.where(torch.ones(4, 4, dtype=torch.bool).tril(), x, torch.tensor(-30000.0, dtype=torch.float64)),
    ),
    "elementwise unary and binary ops": (
        {"x": "f32[6]", "y": "f32[6]"},
        [
            "%a = f32[6] logistic(%x)",
            "%b = f32[6] multiply(%a, %y)",
            "%c = f32[6] cosine(%b)",
            "%d = f32[6] sine(%x)",
            "%e = f32[6] maximum(%c, %d)",
            "%f = f32[6] negate(%e)",
            "%g = f32[6] tanh(%f)",
            "%h = f16[6] convert(%g)",
        ],
        lambda x, y: torch.tanh(-torch.maximum(torch.cos(torch.sigmoid(x) * y), torch.sin(x))),
    ),
    "explicit constant array": (
        {"x": "f32[2,2]"},
        ["%k = f32[2,2] constant({ { 1, 2 }, { 3, 4.5 } })", "%m = f32[2,2] multiply(%x, %k)"],
        lambda x: x * torch.tensor([[1, 2], [3, 4.5]], dtype=torch.float64),
    ),
    "Neuron RMS norm over dim 0": (
        {"x": "f32[4,3,2]", "w": "f32[4]"},
        ['%eps = f32[] constant(1e-05)', '%n = f16[4,3,2] custom-call(%x, %w, %eps), custom_call_target="AwsNeuronRmsNorm", backend_config="0"'],
        lambda x, w: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-5) * w[:, None, None],
    ),
    "gather of one row (last-token pick)": (
        {"x": "f32[5,3,2]", "i": "s32[1]"},
        ["%g = f32[1,3,2] gather(%x, %i), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,3,2}"],
        lambda x, i: x[i],
    ),
    "gather along an inner dim": (
        {"x": "f32[3,5,2]", "i": "s32[4]"},
        ["%g = f32[3,4,2] gather(%x, %i), offset_dims={0,2}, collapsed_slice_dims={1}, start_index_map={1}, index_vector_dim=1, slice_sizes={3,1,2}"],
        lambda x, i: x[:, i],
    ),
    "tuple and get-tuple-element": (
        {"x": "f32[2]", "y": "f32[2]"},
        ["%t = (f32[2], f32[2]) tuple(%x, %y)", "%g = f32[2] get-tuple-element(%t), index=1"],
        lambda x, y: y,
    ),
    "call and fusion inlined": (
        {"x": "f32[3]", "y": "f32[3]"},
        ["%c = f32[3] call(%x, %y), to_apply=%mul_f32", "%f = f32[3] fusion(%c, %x), kind=kLoop, calls=%mul_f32"],
        lambda x, y: x * y * x,
    ),
    "dynamic-slice at constant offsets, clamped": (
        {"x": "f32[4,6]"},
        ["%one = s32[] constant(1)", "%nine = s32[] constant(9)", "%s = f32[2,3] dynamic-slice(%x, %one, %nine), dynamic_slice_sizes={2,3}"],
        lambda x: x[1:3, 3:6],
    ),
    "dynamic-update-slice": (
        {"x": "f32[4,5]", "u": "f32[2,2]"},
        ["%one = s32[] constant(1)", "%two = s32[] constant(2)", "%d = f32[4,5] dynamic-update-slice(%x, %u, %one, %two)"],
        lambda x, u: torch.cat([x[:1], torch.cat([x[1:3, :2], u, x[1:3, 4:]], 1), x[3:]], 0),
    ),
    "pad with a negative edge": (
        {"x": "f32[3,4]"},
        ["%z = f32[] constant(0.5)", "%p = f32[4,5] pad(%x, %z), padding=1_0x-1_2"],
        lambda x: torch.nn.functional.pad(x, (-1, 2, 1, 0), value=0.5),
    ),
    "reduce-window as a cumulative sum": (
        {"x": "f32[2,4]"},
        ["%z = f32[] constant(0)", "%r = f32[2,4] reduce-window(%x, %z), window={size=1x4 pad=0_0x3_0}, to_apply=%add_f32"],
        lambda x: x.cumsum(1),
    ),
    "remainder, clamp, sign, power": (
        {"x": "f32[5]", "y": "f32[5]"},
        ["%lo = f32[5] negate(%y)", "%c = f32[5] clamp(%lo, %x, %y)", "%r = f32[5] remainder(%x, %y)", "%s = f32[5] sign(%r)",
         "%a = f32[5] abs(%x)", "%p = f32[5] power(%a, %y)", "%m = f32[5] multiply(%c, %s)", "%o = f32[5] add(%m, %p)"],
        lambda x, y: torch.clamp(x, -y, y) * torch.sign(torch.fmod(x, y)) + x.abs() ** y,
    ),
    "bitcast between layouts is a transpose": (
        {"x": "f32[2,3]"},
        ["%b = f32[3,2]{0,1} bitcast(%x)"],
        lambda x: x.T,
    ),
    "bitcast between row-major layouts is a reshape": (
        {"x": "f32[2,3]"},
        ["%b = f32[3,2]{1,0} bitcast(%x)"],
        lambda x: x.reshape(3, 2),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lowering_computes_the_instruction(name: str) -> None:
    params, body, expected = CASES[name]
    gen = torch.Generator().manual_seed(0)
    inputs = {
        n: torch.randint(0, 3, _dims(t), generator=gen) if t.startswith("s32") else torch.randn(_dims(t), generator=gen, dtype=torch.float64)
        for n, t in params.items()
    }
    (got,) = run(hlo(params, body), **inputs)
    torch.testing.assert_close(got, expected(*inputs.values()))


def _dims(ty: str) -> tuple[int, ...]:
    return tuple(int(d) for d in ty.split("[", 1)[1].rstrip("]").split(",") if d)


SPMD = hlo(
    {"x": "f32[2,3]"},
    [
        "%r = f32[2,3] all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add_f32",
        "%g = f32[4,3] all-gather(%r), dimensions={0}, replica_groups={{0,2},{1,3}}",
        "%s = f32[1,3] reduce-scatter(%g), dimensions={0}, replica_groups={{0,1,2,3}}, to_apply=%add_f32",
        "%t = (f32[1,3], f32[4,3]) tuple(%s, %g)",
    ],
)


def test_collectives_follow_each_ranks_replica_group() -> None:
    module = parse_hlo(SPMD, "spmd.hlo")
    assert world_size_of(module) == 4
    ranks = [lower_hlo(module, r, 4).graph for r in range(4)]
    groups = [[n.attrs[-1] for n in g.nodes if n.op in ("all_reduce", "all_gather", "reduce_scatter")] for g in ranks]
    assert groups[2] == [(2, 3), (0, 2), (0, 1, 2, 3)]
    x = rand(2, 3)
    gathered = torch.cat([2 * x, 2 * x])  # each pair of ranks sums two copies, then pairs gather
    for rank, (scattered, gather) in enumerate(run_ranks(ranks, {"x": x})):
        torch.testing.assert_close(gather, gathered)
        torch.testing.assert_close(scattered, (4 * gathered)[rank : rank + 1])


def test_collective_over_one_rank_is_the_identity() -> None:
    text = hlo({"x": "f32[2]"}, ["%r = f32[2] all-reduce(%x), replica_groups={{0}}, to_apply=%add_f32"])
    graph = lower_hlo(parse_hlo(text, "t.hlo"), 0, 1).graph
    assert [n.op for n in graph.nodes] == ["leaf"]


def test_elided_constants_become_inputs() -> None:
    text = hlo({"x": "f32[3]"}, ["%k = f32[3] constant({...})", "%m = f32[3] multiply(%x, %k)"])
    imported = lower_hlo(parse_hlo(text, "t.hlo"), None, 1)
    assert [(i.name, i.constant) for i in imported.inputs] == [("x", False), ("k", True)]


def test_neuron_stack_list_gives_the_innermost_frame_outside_installed_packages() -> None:
    meta = (
        r"""metadata={op_type="<module>" source_file="/src/test.py\n----\n[\'/src/test.py:46\', """
        r"""\'/src/lib/decoder.py:609\', \'/env/lib/python3.11/site-packages/pyhlo/scribe.py:265\']" source_line=46}"""
    )
    text = hlo({"x": "f32[2]"}, [f"%n = f32[2] negate(%x), {meta}"])
    graph = lower_hlo(parse_hlo(text, "t.hlo"), None, 1).graph
    loc = graph.nodes[-1].loc
    assert (loc.file, loc.line, loc.code) == ("/src/lib/decoder.py", 609, "negate(%x)")


def test_unknown_opcode_and_custom_call_are_unsupported() -> None:
    for body in (["%w = f32[2] while(%x), condition=%c, body=%b"], ['%w = f32[2] custom-call(%x), custom_call_target="Mystery"']):
        with pytest.raises(UnsupportedOp, match="t.hlo:"):
            lower_hlo(parse_hlo(hlo({"x": "f32[2]"}, body), "t.hlo"), None, 1)


def test_strided_slice_is_unsupported() -> None:
    with pytest.raises(UnsupportedOp, match="stride"):
        run(hlo({"x": "f32[4]"}, ["%s = f32[2] slice(%x), slice={[0:4:2]}"]), x=rand(4))


def test_layout_changing_bitcast_is_read_as_a_transpose_not_a_reshape() -> None:
    """f32[2,3]{1,0} and f32[3,2]{0,1} lay the same numbers out alike in memory: a bitcast
    between them is the transpose; reading it as a row-major reshape gives other numbers."""
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    (got,) = run(hlo({"x": "f32[2,3]{1,0}"}, ["%b = f32[3,2]{0,1} bitcast(%x)"]), x=x)
    assert torch.equal(got, x.T) and not torch.equal(x.T, x.reshape(3, 2))


def test_partition_id_offsets_and_tuple_collectives_per_rank() -> None:
    """A rank's slice by `partition-id` times a size is a static slice on each rank; an all-reduce
    of two operands returns both reduced."""
    text = hlo(
        {"x": "f32[4,3]"},
        [
            "%id = u32[] partition-id()",
            "%two = u32[] constant(2)",
            "%start = u32[] multiply(%id, %two)",
            "%zero = u32[] constant(0)",
            "%s = f32[2,3] dynamic-slice(%x, %start, %zero), dynamic_slice_sizes={2,3}",
            "%r = (f32[2,3], f32[4,3]) all-reduce(%s, %x), replica_groups=[1,2]<=[2], to_apply=%add_f32",
        ],
    )
    module = parse_hlo(text, "t.hlo")
    x = rand(4, 3)
    ranks = [lower_hlo(module, r, 2) for r in range(2)]
    outputs = run_ranks([g.graph for g in ranks], {"x": x})
    for out in outputs:
        torch.testing.assert_close(out[0], x[0:2] + x[2:4])
        torch.testing.assert_close(out[1], 2 * x)


@pytest.mark.parametrize(
    "params, body, expected",
    [
        ({"x": "f32[2,3]"}, ["%y = f32[4,2] reshape(%x)"], "operands that `view` accepts, but [2, 3] do not fit"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,3] transpose(%x), dimensions={1,0}"], "the declared shape [2, 3], but `transpose` computes [3, 2]"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,3] transpose(%x), dimensions={0,0}"], "operands that `permute` accepts"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,4] add(%x, %x)"], "operands of the declared shape [2, 4] (HLO does not broadcast)"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,3] exponential(%x, %x)"], "1 operand for `exp`, not 2"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,3] copy(%x, %x)"], "1 operand for `copy`"),
        ({"x": "f32[3]"}, ["%y = f32[3,2] broadcast(%x), dimensions={1}"], "operand dims [3] at distinct dims={1} of [3, 2]"),
        ({"a": "f32[2,3]", "b": "f32[2,3]"}, ["%y = f32[2,3] dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"],
         "batch and contracting dims of equal sizes"),
        ({"x": "f32[2,3]"}, ["%y = f32[2] slice(%x), slice={[0:2]}"], "one [start:end] per operand dim (2)"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,2] slice(%x), slice={[0:2], [2:4]}"], "operands that `slice` accepts"),
        ({"a": "f32[2,3]", "b": "f32[3,3]"}, ["%y = f32[2,6] concatenate(%a, %b), dimensions={1}"], "operands that `cat` accepts"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,3] iota(), iota_dimension=5"], "a `iota` whose attributes fit its operands (IndexError"),
        ({"x": "f32[2,3]"}, ["%y = f32[2,3] all-reduce(%x), replica_groups={{0,0}}, to_apply=%add_f32"],
         "replica groups holding each of ranks 0..1 at most once"),
    ],
    ids=["reshape-count", "declared-vs-computed", "not-a-permutation", "implicit-broadcast", "operand-count", "extra-operand",
         "broadcast-dims", "contracting-sizes", "slice-ranges", "slice-bounds", "concatenate", "attribute-past-rank", "replica-groups"],
)
def test_an_instruction_its_operands_do_not_fit_is_refused_at_its_line(params: dict, body: list[str], expected: str) -> None:
    with pytest.raises(GraphFileError) as err:
        lower_hlo(parse_hlo(hlo(params, body), "t.hlo"), 0, 2)
    line = hlo(params, body).splitlines().index(f"  ROOT {body[-1]}") + 1
    assert str(err.value).startswith(f"t.hlo:{line}: expected {expected}"), str(err.value)


def test_a_reducer_that_lost_a_parameter_is_refused() -> None:
    text = hlo({"x": "f32[2,3]"}, ["%z = f32[] constant(0)", "%y = f32[3] reduce(%x, %z), dimensions={0}, to_apply=%add_f32"])
    broken = text.replace("ROOT %c = f32[] add(%a, %b)", "ROOT %c = f32[] add(%a, %a)")
    assert broken != text
    with pytest.raises(GraphFileError, match="expected a reducer combining its two parameters"):
        lower_hlo(parse_hlo(broken, "t.hlo"), None, 1)
