"""The HLO text parser: instructions, types, raw attributes, and errors that say where and what."""

from __future__ import annotations

import pytest

from shardproof.errors import GraphFileError
from shardproof.importers.hlo_text import groups, int_list, parse_hlo, slice_ranges, unquote

MODULE = """HloModule tiny, entry_computation_layout={(f32[2,3]{1,0})->(f32[3]{0}, f32[2,3]{1,0})}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p0: f32[2,3]) -> (f32[3], f32[2,3]) {
  %p0 = f32[2,3]{1,0} parameter(0), metadata={op_type="x" source_file="a, b {c}.py" source_line=7}
  %zero = f32[] constant(0)
  %r = f32[3]{0} reduce(%p0, %zero), dimensions={0}, to_apply=%sum
  ROOT %t = (f32[3]{0}, f32[2,3]{1,0}) tuple(%r, %p0)
}
"""


def test_parses_computations_types_operands_and_raw_attributes() -> None:
    module = parse_hlo(MODULE, "tiny.hlo")
    assert module.entry == "main" and set(module.computations) == {"sum", "main"}
    assert module.computations["sum"].root.opcode == "add"
    assert module.computations["sum"].root.operands == ["a", "b"]  # typed operands keep their names
    entry = module.entry_computation
    p0, zero, r, t = entry.instructions
    assert (p0.type.dtype, p0.type.dims, p0.literal) == ("float32", (2, 3), "0")
    assert 'source_line=7' in p0.attrs["metadata"]  # commas and braces inside strings do not split
    assert zero.literal == "0" and r.attrs == {"dimensions": "{0}", "to_apply": "%sum"}
    assert t.root and t.type.dtype == "tuple" and [e.dims for e in t.type.elements] == [(3,), (2, 3)]
    assert entry.root is t and r.line == 12


def test_attribute_readers() -> None:
    assert int_list("{2,0,1}") == (2, 0, 1) and int_list("{}") == ()
    assert groups("{{0,1},{2,3}}") == [(0, 1), (2, 3)] and groups("{}") == []
    assert slice_ranges("{[0:256], [4:8:2]}") == [(0, 256, 1), (4, 8, 2)]
    assert unquote(r'"a\nb \'c\'"') == "a\nb 'c'"


@pytest.mark.parametrize(
    "line, expected",
    [
        ("  %x = f32[2] add(%a, %b", "a closing `)`"),
        ("  %x = q32[2] add(%a, %b)", "an element type"),
        ("  %x f32[2] add(%a, %b)", "`=` after the instruction name"),
        ("  %x = f32[2] add(%a, %b) junk", "`, key=value` or the end of the instruction"),
    ],
)
def test_malformed_line_names_file_line_and_expectation(line: str, expected: str) -> None:
    text = MODULE.replace("  %zero = f32[] constant(0)", line)
    with pytest.raises(GraphFileError) as err:
        parse_hlo(text, "bad.hlo")
    assert err.value.path == "bad.hlo" and err.value.line == 11
    assert str(err.value).startswith("bad.hlo:11: expected " + expected)


def test_not_an_hlo_module() -> None:
    with pytest.raises(GraphFileError, match="expected an `HloModule name` line"):
        parse_hlo("%x = f32[] constant(0)\n", "x.hlo")


def test_unclosed_computation() -> None:
    with pytest.raises(GraphFileError, match="closing computation main"):
        parse_hlo(MODULE.rstrip().rstrip("}"), "x.hlo")


FRAMES = """HloModule jax, num_partitions=2

FileNames
1 "/home/u/model.py"

FunctionNames
1 "block"
2 "linear"

FileLocations
1 {file_name_id=1 function_name_id=1 line=20 end_line=20 column=4 end_column=9}
2 {file_name_id=1 function_name_id=2 line=5 end_line=5 column=11 end_column=16}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}


ENTRY main.1 {
  x.1 = f32[2]{0} parameter(0)
  t.2 = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}) tuple(x.1, x.1, x.1, x.1, x.1, /*index=5*/x.1), metadata={op_name="t" stack_frame_id=2}
  ROOT r.3 = f32[2]{0} all-reduce(x.1), replica_groups=mesh['dp'=2,'tp'=2] {'tp'}, to_apply=add
}
"""


def test_stack_frame_tables_index_comments_and_mesh_groups() -> None:
    module = parse_hlo(FRAMES, "jax.hlo")
    t, r = module.entry_computation.instructions[1:]
    assert len(t.type.elements) == 6 and t.operands == ["x.1"] * 6
    assert [(f.function, f.line) for f in module.stack(2)] == [("block", 20), ("linear", 5)]
    assert groups(r.attrs["replica_groups"]) == [(0, 1), (2, 3)] and "num_partitions=2" in module.header


def test_replica_groups_in_iota_and_sub_axis_form() -> None:
    assert groups("[2,2]<=[4]") == [(0, 1), (2, 3)] and groups("[2,2]<=[2,2]T(1,0)") == [(0, 2), (1, 3)]
    assert groups("mesh['dp'=2,'tp'=2] {'dp'}") == [(0, 2), (1, 3)]
    assert groups("mesh['a'=8] {'a':(1)2}") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups("mesh['a'=8] {'a':(4)2}") == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize(
    "old, new, line, expected",
    [
        ("  %zero = f32[] constant(0)\n  %r = ", "  %r = ", 11, "operands defined above their use: `%zero` is not (it is defined nowhere)"),
        ("  %zero = f32[] constant(0)\n  %r = f32[3]{0} reduce(%p0, %zero), dimensions={0}, to_apply=%sum\n",
         "  %r = f32[3]{0} reduce(%p0, %zero), dimensions={0}, to_apply=%sum\n  %zero = f32[] constant(0)\n", 11,
         "operands defined above their use: `%zero` is not (it is defined below, at line 12)"),
        ("  %zero = f32[] constant(0)\n", "  %zero = f32[] constant(0)\n  %zero = f32[] constant(1)\n", 12, "a new instruction name (`%zero` is defined at line 11)"),
        ("%b = f32[] parameter(1)", "%b = f32[] parameter(2)", 5, "parameters numbered 0..1, each once"),
        ("%p0 = f32[2,3]{1,0} parameter(0)", "%p0 = f32[2,4]{1,0} parameter(0)", 10, "the header's type for parameter 0"),
        ("%p0 = f32[2,3]{1,0} parameter(0)", "%p0 = f32[2,3]{1,22} parameter(0)", 10, "a layout that is a permutation of the dims 0..1"),
        ("  ROOT %t = (f32[3]{0}, f32[2,3]{1,0})", "  ROOT %t = (f32[3]{0}, f32[3,2]{1,0})", 13, "the header's result type"),
        ("  %zero = f32[] constant(0)\n", "  ROOT %zero = f32[] constant(0)\n", 13, "one ROOT in computation `main` (another at line 11)"),
    ],
    ids=["undefined", "used-before-defined", "defined-twice", "parameter-number", "parameter-type", "layout", "root-type", "two-roots"],
)
def test_a_module_that_contradicts_itself_is_refused_at_its_line(old: str, new: str, line: int, expected: str) -> None:
    assert old in MODULE
    with pytest.raises(GraphFileError) as err:
        parse_hlo(MODULE.replace(old, new), "bad.hlo")
    assert str(err.value).startswith(f"bad.hlo:{line}: expected {expected}")
