"""rank_flow: from an op's line back to the line that gave a name holding a rank a number or a
regrouped rank (the line to fix), or an offset computed with a number or a neighbour's rank in the
rank's place, in the line itself, its conditions, and through assignments, `self.x`, the calls
that pass parameters and the calls whose results (their `return`s) the values are; a number before a nearer regrouping; none in a
program that passes the rank along, or a name, a call, a field or an element that may be one, or
loops over ranks; only the calls the distributed side's functions make count, also in their file
when the op's is another."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from shardproof.ir.graph import Graph, Location
from shardproof.report.rank_flow import NUMBER, REGROUPED, chosen_on, cut_lines, rank_choice, returned_at

PROGRAMS = {
    "a constructor given 0": """
        class Shard:
            def __init__(self, rank, world_size):
                self.rank, self.rows = rank, 8 // world_size

            def forward(self, x):
                return x[self.rank * self.rows : (self.rank + 1) * self.rows]  # USE

        def distributed(rank, world_size):
            return Shard(0, world_size)  # LOST
    """,
    "an attribute set to 0": """
        class Shard:
            def __init__(self, rank, world_size):
                self.rows = 8 // world_size
                self.rank = 0  # LOST

            def forward(self, x):
                start = self.rank * self.rows
                return x[start : start + self.rows]  # USE
    """,
    "a remainder of no rank": """
        def shard_state(state, rank, world_size, tp=2):
            tp_rank = 0 % tp  # LOST
            return {"w": state["w"].chunk(tp)[tp_rank]}  # USE
    """,
    "a keyword given 0, two calls up": """
        def cut(x, tp_rank, tp_size):
            rows = x.shape[0] // tp_size
            return x[tp_rank * rows : (tp_rank + 1) * rows]  # USE

        class Model:
            def __init__(self, rank, world_size):
                self.rank, self.world_size = rank, world_size

            def forward(self, x):
                return cut(x, tp_rank=self.rank, tp_size=self.world_size)

        def distributed(rank, world_size):
            return Model(
                0,  # LOST
                world_size,
            )
    """,
    "a neighbour's rank passed as the own": """
        def pass_on(x, rank, world_size):
            peer = (rank + 1) % world_size
            return x[peer]  # USE

        def step(x, rank, world_size):
            return pass_on(
                x,
                (rank + 1) % world_size,  # LOST
                world_size,
            )
    """,
    "a number behind a nearer regrouping": """
        class Shard:
            def __init__(self, rank, world_size):
                self.tp_rank = rank % 2

            def forward(self, x):
                return x[self.tp_rank]  # USE

        def distributed(rank, world_size):
            return Shard(0, world_size)  # LOST
    """,
    "a helper called with 0, its result used": """
        def local_rows(rank, world_size):
            per = 8 // world_size
            return range(rank * per, (rank + 1) * per)

        def shard_state(state, rank, world_size):
            rows = local_rows(0, world_size)  # LOST
            return {"w": state["w"][rows.start : rows.stop]}  # USE
    """,
    "a number in a helper's offsets, its result used": """
        def local_rows(rank, world_size):
            per = 8 // world_size
            rows = range(0 * per, (rank + 1) * per)  # LOST
            return rows

        def shard_state(state, rank, world_size):
            rows = local_rows(rank, world_size)
            return {"w": state["w"][rows.start : rows.stop]}  # USE
    """,
    "a constructor given 0, read through a method's result": """
        class Attention:
            def __init__(self, tp_rank=0):
                self.tp_rank = tp_rank

            def split(self, qkv):
                q = qkv.chunk(2)[self.tp_rank]
                return q

            def forward(self, x):
                q = self.split(x)
                return q @ q.T  # USE

        def distributed(rank, world_size):
            return Attention(tp_rank=0)  # LOST
    """,
    "a neighbour's rank in an offset": """
        class Shard:
            def __init__(self, rank, world_size):
                self.rows = 8 // world_size
                self.start = ((rank + 1) % world_size) * self.rows  # LOST

            def forward(self, x):
                return x[self.start : self.start + self.rows]  # USE
    """,
    "a neighbour's rank deciding whether the line runs": """
        def visible(source, rank):
            return source <= rank

        def attend(blocks, rank, world_size):
            out = blocks[0]
            for step in range(1, world_size):
                if not visible((rank - step) % world_size, (rank + 1) % world_size):  # LOST
                    continue
                out = out + blocks[step]  # USE
            return out
    """,
    "a group's first expert at a number": """
        class Experts:
            def __init__(self, rank, ep):
                self.first = 0 % ep * (8 // ep)  # LOST

            def forward(self, x):
                return x[self.first : self.first + 8 // self.ep]  # USE
    """,
    "a number in the offsets of arguments passed starred": """
        def attend(q, k, v):
            return q @ k.T + v  # USE

        def heads(x, rank, world_size):
            n = 4 // world_size
            return x[:, 0 * n : (rank + 1) * n]  # LOST

        def forward(x, rank, world_size):
            return attend(*(heads(t, rank, world_size) for t in (x, x, x)))
    """,
}

FINE = {
    "the rank passed along": PROGRAMS["a constructor given 0"].replace("Shard(0,", "Shard(rank,"),
    "a rank from a call": PROGRAMS["an attribute set to 0"].replace("self.rank = 0", "self.rank = dist.get_rank()"),
    "a rank from a field": PROGRAMS["a remainder of no rank"].replace("0 % tp", "state['coords'].tp"),
    "a helper called with the rank": PROGRAMS["a helper called with 0, its result used"].replace("(0,", "(rank,"),
    "a neighbour's rank, by name": PROGRAMS["a constructor given 0"].replace(
        "return Shard(0, world_size)", "peer = (rank + 1) % world_size\n            return Shard(peer, world_size)"),
    "a helper's offsets from the rank": PROGRAMS["a number in a helper's offsets, its result used"].replace("0 * per", "rank * per"),
    "a method's result from the rank passed": PROGRAMS["a constructor given 0, read through a method's result"].replace(
        "tp_rank=0)", "tp_rank=rank)"),
    "a neighbour's rank, by name, in an offset": PROGRAMS["a neighbour's rank in an offset"].replace(
        "self.start = ((rank + 1) % world_size) * self.rows",
        "peer = (rank + 1) % world_size\n                self.start = peer * self.rows"),
    "a group's first expert": """
        class Experts:
            def __init__(self, rank, ep):
                self.first = rank % ep * (8 // ep)

            def forward(self, x):
                return x[self.first : self.first + 8 // self.ep]  # USE
    """,
    "the rank deciding whether the line runs": PROGRAMS["a neighbour's rank deciding whether the line runs"].replace(
        ", (rank + 1) % world_size)", ", rank)"),
    "arguments passed starred, cut by the rank": PROGRAMS["a number in the offsets of arguments passed starred"].replace(
        "0 * n", "rank * n"),
    "a loop over ranks": """
        def cut(x, rank, world_size):
            return x[rank::world_size]  # USE

        def every_shard(x):
            return [cut(x, rank, 2) for rank in (0, 1)]
    """,
    "a root's rank": """
        class Broadcast:
            def __init__(self):
                self.root_rank = 0

            def forward(self, x):
                return x[self.root_rank]  # USE
    """,
    "a low-rank projection's width": """
        class Attention:
            def __init__(self, dim):
                self.kv_lora_rank = 0

            def forward(self, x):
                return x[: self.kv_lora_rank]  # USE
    """,
    "a count of ranks": """
        def cut(x, world_size):
            n_rank = 2
            return x[: x.shape[0] // n_rank]  # USE
    """,
    "a count per rank": """
        def layers(x, stages_left):
            if stages_left > 0:
                num_layers_per_pipeline_rank = x.shape[0] // stages_left
            else:
                num_layers_per_pipeline_rank = 0
            return x[:num_layers_per_pipeline_rank].sum()  # USE
    """,
}


def _lines(tmp_path: Path, source: str) -> tuple[str, dict[str, int]]:
    text = textwrap.dedent(source)
    path = tmp_path / "program.py"
    path.write_text(text)
    marks = {mark: number for number, line in enumerate(text.splitlines(), 1) for mark in ("USE", "LOST")
             if line.endswith(f"# {mark}")}
    return str(path), marks


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_line_that_lost_the_rank_is_found_from_its_use(tmp_path: Path, name: str) -> None:
    path, marks = _lines(tmp_path, PROGRAMS[name])
    lost = rank_choice(path, marks["USE"])
    assert lost is not None and lost.line == marks["LOST"], lost


@pytest.mark.parametrize("name", FINE)
def test_no_line_lost_a_rank_where_one_is_passed_or_may_be(tmp_path: Path, name: str) -> None:
    path, marks = _lines(tmp_path, FINE[name])
    assert rank_choice(path, marks["USE"]) is None


WHATS = {"a neighbour's rank passed as the own": REGROUPED, "a neighbour's rank in an offset": REGROUPED,
         "a neighbour's rank deciding whether the line runs": REGROUPED}


@pytest.mark.parametrize("name", PROGRAMS)
def test_what_the_rank_was_given_is_said(tmp_path: Path, name: str) -> None:
    path, marks = _lines(tmp_path, PROGRAMS[name])
    choice = rank_choice(path, marks["USE"])
    assert choice is not None and choice.what == WHATS.get(name, NUMBER), choice


def test_only_the_calls_the_distributed_side_makes_pass_its_rank(tmp_path: Path) -> None:
    """The reference built from the same class with rank 0 (world size 1) is no finding of the distributed side's."""
    source = PROGRAMS["a constructor given 0"].replace("Shard(0, world_size)  # LOST", "Shard(rank, world_size)") + """
        def reference():
            return Shard(0, 1)
    """
    path, marks = _lines(tmp_path, source)
    entry = next(number for number, line in enumerate(Path(path).read_text().splitlines(), 1) if "def distributed" in line)
    assert rank_choice(path, marks["USE"], frozenset({(path, entry)})) is None
    assert rank_choice(path, marks["USE"]) is not None  # without entries, every call counts


def test_an_edited_file_is_read_again(tmp_path: Path) -> None:
    path, marks = _lines(tmp_path, PROGRAMS["a constructor given 0"])
    assert rank_choice(path, marks["USE"]) is not None
    Path(path).write_text(textwrap.dedent(FINE["the rank passed along"]) + "\n")
    assert rank_choice(path, marks["USE"]) is None


def test_a_file_that_cannot_be_read_names_no_line(tmp_path: Path) -> None:
    assert rank_choice(str(tmp_path / "gone.py"), 3) is None


def test_a_line_picking_a_neighbour_or_a_number_itself_is_told(tmp_path: Path) -> None:
    """`chunk(tp)[(tp_rank + 1) % world_size]` after `tp_rank = rank % tp`: the neighbour is picked on
    the use's line, not where the rank was first regrouped; so is a number in an offset."""
    path, marks = _lines(tmp_path, """
        def shard_state(state, rank, world_size):
            tp_rank = rank % 2
            w = state["w"][0 * 4 : (tp_rank + 1) * 4]  # LOST
            return {"w": state["w"].chunk(2)[(tp_rank + 1) % world_size]}  # USE
    """)
    assert chosen_on(path, marks["USE"]).what == REGROUPED
    assert chosen_on(path, marks["LOST"]).what == NUMBER
    assert chosen_on(path, marks["LOST"] - 1) is None  # a group's rank, not a neighbour's


@pytest.mark.parametrize("passed, lost", [("0", True), ("rank", False)])
def test_a_constructor_in_another_file_given_0_by_the_case(tmp_path: Path, passed: str, lost: bool) -> None:
    """The class in a library module, constructed by the case's distributed side: its call counts,
    the reference's (`Shard(0, 1)`, outside the distributed side) does not."""
    layers, marks = _lines(tmp_path, PROGRAMS["a constructor given 0"].split("def distributed")[0])
    case = tmp_path / "case.py"
    case.write_text(textwrap.dedent(f"""
        from program import Shard

        def reference():
            return Shard(0, 1)

        def distributed(rank, world_size):
            return Shard({passed}, world_size)  # LOST
    """))
    entry = next(n for n, line in enumerate(case.read_text().splitlines(), 1) if "def distributed" in line)
    choice = rank_choice(layers, marks["USE"], frozenset({(str(case), entry)}))
    if lost:
        assert choice is not None and (choice.file, choice.line) == (str(case), entry + 1) and choice.what == NUMBER
    else:
        assert choice is None, choice


def test_the_line_a_function_returns_its_value_from(tmp_path: Path) -> None:
    """The function's own last `return` of a value (not a nested function's, not a bare one), a
    lambda's body; none for a function returning nothing or a line no function starts at."""
    path = tmp_path / "built.py"
    path.write_text(textwrap.dedent("""\
        def distributed(rank, world_size):
            def helper():
                return 0
            if rank:
                return Stack(rank)
            return Stack(helper())

        build = lambda rank, world_size: Stack(rank)

        def nothing():
            return
        """))
    assert returned_at(str(path), 1) == (6, "return Stack(helper())")
    assert returned_at(str(path), 8) == (8, "build = lambda rank, world_size: Stack(rank)")
    assert returned_at(str(path), 10) is None and returned_at(str(path), 4) is None
    assert returned_at(str(tmp_path / "gone.py"), 1) is None


def test_the_cut_lines_are_those_of_the_ops_on_the_leaves_alone_that_the_nodes_read() -> None:
    """shard_state's slices of the state and shard_input's of the inputs, and the program's moves of
    them (layout ops on leaves or on such ops), upstream of the nodes, nearest first; not an op
    computing with them, not a cut the nodes do not read, nothing for a node of another graph."""
    graph = Graph()
    at = lambda line: Location("case.py", line, "")  # noqa: E731
    weight = graph.add("leaf", (), ("state:w",), (4, 4), "f32", "w")
    x = graph.add("leaf", (), ("input:0",), (2, 4), "f32", "x")
    rows = graph.add("slice", (weight,), (0, 0, 2), (2, 4), "f32", "rows", at(11))
    flat = graph.add("view", (rows,), ((8,),), (8,), "f32", "flat", at(12))
    tokens = graph.add("slice", (x,), (0, 0, 1), (1, 4), "f32", "tokens", at(20))
    unread = graph.add("slice", (weight,), (0, 2, 4), (2, 4), "f32", "unread", at(13))
    back = graph.add("view", (flat,), ((2, 4),), (2, 4), "f32", "back", at(30))
    out = graph.add("matmul", (tokens, back), (), (1, 2), "f32", "out", at(31))
    assert cut_lines(graph, [graph[out]]) == [("case.py", 20), ("case.py", 30), ("case.py", 12), ("case.py", 11)]  # not 31
    assert cut_lines(graph, [graph[unread]]) == [("case.py", 13)]
    other = Graph()
    other.add("leaf", (), ("state:w",), (4, 4), "f32", "w")
    assert cut_lines(graph, [other[0]]) == []
