"""The FX readable dump importer, run numerically: graphs traced here with make_fx and printed with
`print_readable` (aten forward, backward and indexing ops), and hand-written dumps of the fused
kernels real stacks emit (apex, vLLM), must compute what torch computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from shardproof.errors import GraphFileError
from shardproof.importers.fx_dump import load_fx
from shardproof.ir.run import run_graph


def dumped(tmp_path: Path, fn, *inputs: torch.Tensor) -> Path:
    path = tmp_path / "graph.py"
    path.write_text(make_fx(fn)(*inputs).print_readable(print_output=False))
    return path


def run_dump(path: Path, *inputs: torch.Tensor, world_size: int = 1) -> list[torch.Tensor]:
    imported = load_fx(str(path), 0, world_size)
    params = [i for i in imported.inputs if not i.constant]
    return run_graph(imported.graph, {i.name: x for i, x in zip(params, inputs)})


def f64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _forward(x, w, b, ids, table):
    h = F.layer_norm(x, (4,), w, b)
    h = F.gelu(h @ table.T) + torch.softmax(h, -1).sum(-1, keepdim=True)
    rows = table[ids]
    return h, rows, torch.max(h, -1)[0]


def _backward(x, w, table, ids):
    x, w, table = (t.detach().requires_grad_() for t in (x, w, table))
    scores = torch.softmax(F.gelu(x @ w), -1)
    loss = (scores * F.embedding(ids, table)).sum()
    return torch.autograd.grad(loss, (x, w, table))


def _cross_entropy_lookup(logits, target):
    rows = torch.arange(logits.shape[0])
    picked = logits[rows, target]
    updated = logits.clone()
    updated[rows, target] = picked - 1.0
    return picked, updated


def _masked_embedding_backward(table, ids, grad):
    """Megatron's vocab-parallel embedding on the rank owning ids [2, 6): its weight gradient."""
    mask = (ids < 2) | (ids >= 6)
    table = table.detach().requires_grad_()
    out = F.embedding(torch.where(mask, 0, ids - 2), table).masked_fill(mask[..., None], 0.0)
    return torch.autograd.grad(out, table, grad)


@pytest.mark.parametrize(
    "fn, inputs",
    [
        (_masked_embedding_backward, lambda: (f64(4, 3), torch.tensor([[0, 2, 5, 7, 3], [6, 1, 4, 2, 2]]), f64(2, 5, 3))),
        (_forward, lambda: (f64(3, 4), f64(4), f64(4), torch.tensor([1, 0, 2]), f64(5, 4))),
        (_backward, lambda: (f64(3, 4), f64(4, 5), f64(6, 5), torch.tensor([[0, 5, 2], [1, 1, 4], [3, 0, 0]]))),
        (_cross_entropy_lookup, lambda: (f64(4, 6), torch.tensor([5, 0, 2, 2]))),
    ],
    ids=["masked-embedding-backward", "forward", "backward", "cross-entropy-lookup"],
)
def test_make_fx_dumps_compute_what_torch_computes(tmp_path: Path, fn, inputs) -> None:
    values = inputs()
    path = dumped(tmp_path, fn, *values)
    got = run_dump(path, *values)
    want = fn(*values)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_row_masked_embedding_gradient_carries_the_mask_in_its_one_hot(tmp_path: Path) -> None:
    """So that a rank's one-hot is a slice of the reference's (the numbers are checked above)."""
    ids = torch.tensor([[0, 2, 5, 7, 3], [6, 1, 4, 2, 2]])
    graph = load_fx(str(dumped(tmp_path, _masked_embedding_backward, f64(4, 3), ids, f64(2, 5, 3))), 0, 1).graph
    (hot,) = [n for n in graph.nodes if n.op == "scatter_add"]
    weights = graph[hot.inputs[2]]
    assert weights.op == "convert" and graph[weights.inputs[0]].op == "logical_not"


KERNELS = '''
class <lambda>(torch.nn.Module):
    def forward(self, primals, tangents):
        x: "f32[6, 4]"; w: "f32[4]"; bias: "f32[4]"; res: "f32[6, 4]"; qkv: "f32[6, 16]"; pos: "i64[6]"; cache: "f32[8, 4]"; up: "f32[6, 6]"; grad: "f32[6, 4]"

        x, w, bias, res, qkv, pos, cache, up, grad, = fx_pytree.tree_flatten_spec([primals, tangents], self._in_spec)
         # File: /src/model.py:10 in forward, code: h = self.norm(x)
        ln = torch.ops.apex.fused_layer_norm_affine_fwd.default(x, w, bias, [4], 1e-05)
        ln_out: "f32[6, 4]" = ln[0]
        ln_mean: "f32[6]" = ln[1]
        ln_invvar: "f32[6]" = ln[2];  ln = None
        ln_bwd = torch.ops.apex.fused_layer_norm_affine_bwd.default(grad, ln_mean, ln_invvar, x, [4], w, bias, 1e-05)
        grad_x: "f32[6, 4]" = ln_bwd[0]
        grad_w: "f32[4]" = ln_bwd[1]
        grad_b: "f32[4]" = ln_bwd[2];  ln_bwd = None
        empty: "f32[6, 4]" = torch.ops.aten.empty.memory_format([6, 4], dtype = torch.float32, device = device(type='cuda', index=0), pin_memory = False)
         # File: /src/model.py:11 in forward, code: h = rms_norm(x)
        af = torch.ops.higher_order.auto_functionalized(torch.ops._C.rms_norm.default, result = empty, input = x, weight = w, epsilon = 1e-06);  empty = None
        rms: "f32[6, 4]" = af[1];  af = None
        af_1 = torch.ops.higher_order.auto_functionalized(torch.ops._C.fused_add_rms_norm.default, input = x, residual = res, weight = w, epsilon = 1e-06)
        added_norm: "f32[6, 4]" = af_1[1]
        added: "f32[6, 4]" = af_1[2];  af_1 = None
        empty_1: "f32[6, 3]" = torch.ops.aten.empty.memory_format([6, 3], dtype = torch.float32, device = device(type='cuda', index=0), pin_memory = False)
        af_2 = torch.ops.higher_order.auto_functionalized(torch.ops._C.silu_and_mul.default, out = empty_1, input = up)
        swiglu: "f32[6, 3]" = af_2[1];  af_2 = None
        split = torch.ops.aten.split_with_sizes.default(qkv, [8, 4, 4], -1)
        q: "f32[6, 8]" = split[0]
        k: "f32[6, 4]" = split[1]
        v: "f32[6, 4]" = split[2];  split = None
        af_3 = torch.ops.higher_order.auto_functionalized(torch.ops._C.rotary_embedding.default, positions = pos, query = q, key = k, head_size = 4, cos_sin_cache = cache, is_neox = True)
        q_rot: "f32[6, 8]" = af_3[1]
        k_rot: "f32[6, 4]" = af_3[2];  af_3 = None
        q3: "f32[6, 2, 4]" = torch.ops.aten.view.default(q_rot, [-1, 2, 4])
        k3: "f32[6, 1, 4]" = torch.ops.aten.view.default(k_rot, [-1, 1, 4])
        v3: "f32[6, 1, 4]" = torch.ops.aten.view.default(v, [-1, 1, 4])
        out: "f32[6, 2, 4]" = torch.ops.aten.empty.memory_format([6, 2, 4], dtype = torch.float32, device = device(type='cuda', index=0), pin_memory = False)
        af_4 = torch.ops.higher_order.auto_functionalized(torch.ops.vllm.unified_attention_with_output.default, query = q3, key = k3, value = v3, output = out, layer_name = 'layers.0.attn')
        attn: "f32[6, 2, 4]" = af_4[1];  af_4 = None
        clone: "f32[4]" = torch.ops.aten.clone.default(w)
        af_5 = torch.ops.higher_order.auto_functionalized_v2(torch.ops.tg.inplace_log_tensor.default, s = 'decoder.norm.weight', _t_base_index = 0, _all_bases = [clone]);  clone = None
        logged: "f32[4]" = af_5[1];  af_5 = None
        drop = torch.ops.aten.native_dropout.default(ln_out, 0.1, True)
        dropped: "f32[6, 4]" = drop[0];  drop = None
        return pytree.tree_unflatten([ln_out, ln_mean, grad_x, grad_w, grad_b, rms, added_norm, added, swiglu, q_rot, k_rot, attn, logged, dropped, None], self._out_spec)
'''


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotary(t, pos, cache, head_size):
    cos, sin = cache[pos].chunk(2, -1)
    heads = t.view(t.shape[0], -1, head_size)
    x1, x2 = heads.chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).view(t.shape)


def test_kernels_of_real_dumps_compute_what_they_mean(tmp_path: Path) -> None:
    path = tmp_path / "kernels.py"
    path.write_text(KERNELS)
    x, w, bias, res, qkv = f64(6, 4), f64(4), f64(4), f64(6, 4), f64(6, 16)
    pos, cache, up, grad = torch.tensor([0, 1, 2, 3, 7, 5]), f64(8, 4), f64(6, 6), f64(6, 4)
    imported = load_fx(str(path), 0, 1)
    assert imported.labels == {"w": "decoder.norm.weight"}
    got = run_dump(path, x, w, bias, res, qkv, pos, cache, up, grad)

    xr = x.detach().requires_grad_()
    wr, br = w.detach().requires_grad_(), bias.detach().requires_grad_()
    ln = F.layer_norm(xr, (4,), wr, br)
    grads = torch.autograd.grad(ln, (xr, wr, br), grad)
    q_rot, k_rot = _rotary(qkv[:, :8], pos, cache, 4), _rotary(qkv[:, 8:12], pos, cache, 4)
    q3, k3, v3 = q_rot.view(6, 2, 4), k_rot.view(6, 1, 4), qkv[:, 12:].reshape(6, 1, 4)
    attn = F.scaled_dot_product_attention(q3.transpose(0, 1), k3.transpose(0, 1).expand(2, 6, 4), v3.transpose(0, 1).expand(2, 6, 4), is_causal=True)
    want = [
        ln, x.mean(-1), *grads, _rms(x, w, 1e-6), _rms(x + res, w, 1e-6), x + res,
        F.silu(up[:, :3]) * up[:, 3:], q_rot, k_rot, attn.transpose(0, 1), w, ln,
    ]  # fmt: skip
    assert len(got) == len(want)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e.detach())


def test_source_lines_come_from_file_comments(tmp_path: Path) -> None:
    path = tmp_path / "kernels.py"
    path.write_text(KERNELS)
    graph = load_fx(str(path), 0, 1).graph
    located = {(n.loc.file, n.loc.line, n.loc.code) for n in graph.nodes if n.loc is not None}
    assert ("/src/model.py", 10, "h = self.norm(x)") in located
    assert ("/src/model.py", 11, "h = rms_norm(x)") in located


JOINT = '''
class GraphModule(torch.nn.Module):
    def forward(self, primals, tangents):
        primals_1: "f32[3]"; primals_2: "f32[3]"; tangents_1: "f32[3]"

        primals_1, primals_2, tangents_1, = fx_pytree.tree_flatten_spec([primals, tangents], self._in_spec)
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(primals_1, primals_2)
        mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(tangents_1, primals_1)
        return pytree.tree_unflatten([mul, primals_1, None, mul_1], self._out_spec)
'''


def test_a_joint_graph_says_which_outputs_are_gradients_of_which_primals(tmp_path: Path) -> None:
    """AOTAutograd returns the forward's outputs, then one gradient per primal (None: not needed)."""
    path = tmp_path / "joint.py"
    path.write_text(JOINT)
    imported = load_fx(str(path), 0, 1)
    assert imported.output_names == ["mul", "primals_1", "mul_1"]
    assert imported.gradient_of == {2: "primals_2"}


CONSTANTS = '''
class GraphModule(torch.nn.Module):
    def forward(self, ids: "i64[5]", table: "f32[8, 3]"):
         # File: /src/emb.py:3 in forward, code: masked[mask] = 0
        lt: "b8[5]" = torch.ops.aten.lt.Scalar(ids, 4)
        _tensor_constant0 = self._tensor_constant0
        lift_fresh_copy: "i64[]" = torch.ops.aten.lift_fresh_copy.default(_tensor_constant0);  _tensor_constant0 = None
        index_put: "i64[5]" = torch.ops.aten.index_put.default(ids, [lt], lift_fresh_copy)
         # File: /src/emb.py:4 in forward, code: return F.apply(x)
        _tensor_constant1 = self._tensor_constant1
        lift_fresh_copy_1: "f32[]" = torch.ops.aten.lift_fresh_copy.default(_tensor_constant1)
        embedding: "f32[5, 3]" = torch.ops.aten.embedding.default(table, index_put)
        mul: "f32[5, 3]" = torch.ops.aten.mul.Tensor(embedding, lift_fresh_copy_1)
        return (mul,)
'''


def test_tensor_constants_take_their_literal_or_become_inputs(tmp_path: Path) -> None:
    path = tmp_path / "constants.py"
    path.write_text(CONSTANTS)
    imported = load_fx(str(path), 0, 1)
    assert [(i.name, i.constant) for i in imported.inputs] == [("ids", False), ("table", False), ("_tensor_constant1", True)]
    ids, table, scale = torch.tensor([0, 5, 3, 7, 1]), f64(8, 3), torch.tensor(2.5, dtype=torch.float64)
    (got,) = run_graph(imported.graph, {"ids": ids, "table": table, "_tensor_constant1": scale})
    torch.testing.assert_close(got, table[torch.where(ids < 4, 0, ids)] * 2.5)


@pytest.mark.parametrize(
    "line, expected",
    [
        ('        y: "f32[3]" = torch.ops.aten.neg.default(x', "Python syntax"),
        ('        y: "q32[3]" = torch.ops.aten.neg.default(x)', 'a tensor annotation like "f32[8, 16]"'),
        ('        y: "f32[3]" = numpy.negative(x)', "a call of a `torch.ops.<namespace>.<op>.<overload>` operator"),
        ('        y: "f32[3]" = torch.ops.aten.neg.default(z)', "a name defined earlier in the graph"),
        ("        for i in x: pass", "an assignment"),
        ('        y: "f32[17677669529663687, 1152]" = torch.ops.aten.neg.default(x)', "a tensor annotation of a size that fits"),
    ],
)
def test_malformed_dump_names_file_line_and_expectation(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "bad.py"
    path.write_text(f'class G(torch.nn.Module):\n    def forward(self, x: "f32[3]"):\n{line}\n        return (x,)\n')
    with pytest.raises(GraphFileError) as err:
        load_fx(str(path), 0, 1)
    assert str(err.value).startswith(f"{path}:3: expected {expected}")


@pytest.mark.parametrize(
    "lines, expected",
    [
        (['        y: "f32[4]" = torch.ops.aten.neg.default(x)'], 'the annotation "f32[4]" to be what the op computes, f32[3]'),
        (['        y: "i64[3]" = torch.ops.aten.neg.default(x)'], 'the annotation "i64[3]" to be what the op computes, f32[3]'),
        (['        y: "f32[3]" = torch.ops.aten.mm.default(x, x)'], "operands that `mm.default` accepts"),
        (['        y: "f32[3]" = torch.ops.aten.mul.Tensor(x, None)'], "operands that `mul.Tensor` accepts"),
        (['        y: "f32[2, 2]" = torch.ops.aten.view.default(x, [2, 2])'], "operands that `view.default` accepts"),
        (["        y = torch.ops.aten.split_with_sizes.default(x, [1, 1])"], "operands that `split_with_sizes.default` accepts"),
        (["        y: \"f32[4]\" = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '0')"],
         'the annotation "f32[4]" to be what the op computes, f32[3]'),
        (["        y: \"f32[3]\" = torch.ops._c10d_functional.all_gather_into_tensor.default(x, 2, '0')"],
         'the annotation "f32[3]" to be what the op computes, f32[6]'),
        (["        s = torch.ops.aten.split_with_sizes.default(x, [1, 2])", '        y: "f32[2]" = s[0]'],
         'the annotation "f32[2]" to be what the op computes, f32[1]'),
        (["        s = torch.ops.aten.split_with_sizes.default(x, [1, 2])", '        y: "f32[1]" = s[2]'], "an index into the 2 outputs of `s`"),
        (['        y: "f32[3]" = torch.ops.aten.neg.default(x)', '        y: "f32[3]" = torch.ops.aten.exp.default(x)'],
         "a new name (`y` is assigned above)"),
    ],
    ids=["shape", "dtype", "operands", "none-operand", "view-count", "split-sizes", "all-reduce", "all-gather", "split-item", "item-index",
         "assigned-twice"],
)
def test_a_dump_that_contradicts_itself_is_refused_at_its_line(tmp_path: Path, lines: list[str], expected: str) -> None:
    path = tmp_path / "bad.py"
    path.write_text('class G(torch.nn.Module):\n    def forward(self, x: "f32[3]"):\n' + "\n".join(lines) + "\n        return (x,)\n")
    with pytest.raises(GraphFileError) as err:
        load_fx(str(path), 0, 1)
    assert str(err.value).startswith(f"{path}:{2 + len(lines)}: expected {expected}"), str(err.value)


@pytest.mark.parametrize("data, line, found", [(b"# ok\n# \xff\n", 2, "UTF-8 text, found `byte 0xff`"), (b"\n\x00\x01binary", 2, "text without NUL bytes")])
def test_a_dump_that_is_no_text_is_refused_with_its_line(tmp_path: Path, data: bytes, line: int, found: str) -> None:
    path = tmp_path / "bad.py"
    path.write_bytes(data)
    with pytest.raises(GraphFileError) as err:
        load_fx(str(path), 0, 1)
    assert str(err.value).startswith(f"{path}:{line}: expected {found}")


def test_a_truncated_dump_without_its_return_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cut.py"
    path.write_text('class G(torch.nn.Module):\n    def forward(self, x: "f32[3]"):\n        y: "f32[3]" = torch.ops.aten.neg.default(x)\n')
    with pytest.raises(GraphFileError, match=r"cut.py:4: expected `return \[outputs\]` ending forward"):
        load_fx(str(path), 0, 1)
