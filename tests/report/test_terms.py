"""The renderer of terms: tensors by name, regions as Python slices, fractions, no internal notation."""

from __future__ import annotations

from fractions import Fraction

from shardproof.ir.aten_ops import Operand
from shardproof.ir.graph import Location, Node
from shardproof.relations.rules import Rules
from shardproof.report.terms import describe, fraction, region, value_name


def test_a_region_of_a_named_tensor_reads_as_a_python_slice() -> None:
    r = Rules()
    w = r.leaf("state:fc2.weight", (8, 1024), "float32")
    assert describe(r.u, r.slice(w, ((0, 8), (256, 512)))) == "fc2.weight[:, 256:512]"
    assert describe(r.u, r.slice(w, ((0, 4), (0, 1024)))) == "fc2.weight[0:4]"
    assert describe(r.u, r.permute(w, (1, 0))) == "fc2.weight.T"


def test_sums_show_their_coefficients_as_fractions() -> None:
    r = Rules()
    a, b = r.leaf("input:0", (4,), "float32"), r.leaf("state:b", (4,), "float32")
    text = describe(r.u, r.lin([(a, Fraction(1)), (b, Fraction(-1, 4))]))
    assert text == "inputs()[0] - 1/4 * b" and "Fraction" not in text
    assert fraction(Fraction(-1, 1)) == "-1" and fraction(Fraction(3, 8)) == "3/8" and fraction(2.0) == "2"


def test_broadcast_is_implicit_where_python_broadcasts() -> None:
    r = Rules()
    bias = r.leaf("state:fc2.bias", (8,), "float32")
    assert describe(r.u, r.bcast(bias, (4, 8), (1,))) == "fc2.bias"
    assert describe(r.u, r.bcast(bias, (8, 4), (0,))) == "fc2.bias[:, None]"


def test_a_chain_of_layout_changes_is_not_cut_but_deep_arithmetic_is() -> None:
    r = Rules()
    x = r.leaf("state:wqkv.weight", (2, 40, 4), "float32")
    chain = r.slice(r.permute(r.view(x, (2, 5, 8, 4)), (0, 2, 1, 3)), ((0, 2), (0, 4), (0, 5), (0, 4)))
    assert describe(r.u, chain, 1) == "wqkv.weight.view(2, 5, 8, 4).permute(0, 2, 1, 3)[:, 0:4]"
    assert "…" in describe(r.u, r.build("exp", (r.build("exp", (r.build("exp", (x,), (), (2, 40, 4), "float32"),), (), (2, 40, 4), "float32"),), (), (2, 40, 4), "float32"), 2)


def test_a_value_is_named_by_the_variable_its_line_assigns() -> None:
    def named(code: str) -> str:
        return value_name(Node(0, "mul", (), (), (), "float32", "mul_3", Location("model.py", 31, code)))

    assert named("scores = torch.matmul(q, k)") == "`scores`"
    assert named("out[..., a:b] = local  # write the shard") == "`out[..., a:b]`"
    assert named("return self.down(x)  # BUG") == "`self.down(x)`"
    assert named('"up.weight": ref["up.weight"].chunk(n, 0)[rank],') == 'the "up.weight" entry'
    assert value_name(Node(0, "mul", (), (), (), "float32", "mul_3")) == "the `mul` result"
    backward = Node(0, "sum", (), (), (), "float32", "sum_1", Location("model.py", 31, "y = self.norm(x)", backward=True))
    assert value_name(backward) == "the gradient flowing back through `y`"


def test_a_region_is_the_part_of_a_whole_tensor() -> None:
    r = Rules()
    x, w = r.leaf("input:0", (6, 8), "float32"), r.leaf("state:up.weight", (64, 8), "float32")
    product = r.build("matmul", (x, r.permute(w, (1, 0))), (), (6, 64), "float32")
    found = region(r, "rank 0", r.slice(product, ((0, 6), (32, 64))))
    assert (found.tensor, found.shape, found.box) == ("(inputs()[0] @ up.weight.T)", (6, 64), ((0, 6), (32, 64)))


def test_an_open_op_reads_as_its_torch_call() -> None:
    r = Rules()
    x = r.leaf("input:0", (4, 6), "float32")
    attrs = ((Operand(0), 1), (("dtype", None),), ())
    cumsum = r.literal("aten.cumsum.default", (x,), attrs, (4, 6), "float32")
    assert describe(r.u, cumsum) == "torch.cumsum(inputs()[0], 1, dtype=None)"


def test_a_repeated_module_s_call_reads_as_the_module_called() -> None:
    r = Rules()
    x = r.leaf("input:0", (2, 4), "float32")
    template = object()  # the called module's graph: never shown
    call = r.literal("call", (x,), (template, 0, "model.layers.0.input_layernorm"), (2, 4), "float32")
    assert describe(r.u, call) == "model.layers.0.input_layernorm(inputs()[0])[0]"
