"""role_flow: from a send or recv to a rank's neighbour back to the comparison that gave the rank its
role (the `if` around it, through flags set in a constructor or a function, or compared in the test
itself), or, for a value of another shape sent, the comparison that chose the module computing it;
none where the send is not guarded, the guard compares no rank, the peer is no neighbour. The
driver's use (an unmatched message named first at the flags' line) is tested in
tests/relations/test_messages.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from shardproof.report.role_flow import ROLE, neighbour_peer, role_choice

PROGRAMS = {
    "a stage's flags in its constructor": """
        class Stage:
            def __init__(self, rank, world_size):
                self.rank = rank
                self.is_first, self.is_last = rank == 0, rank == world_size  # ROLE

            def forward(self, x):
                if not self.is_first:
                    dist.recv(x, self.rank - 1)
                if not self.is_last:
                    dist.send(x, self.rank + 1)  # USE
    """,
    "a flag computed in the function": """
        def step(x, rank, world_size):
            stages = 2
            first, last = rank % stages == 0, 0 % stages == stages - 1  # ROLE
            if last:
                return x
            else:
                dist.send(x, rank + 1)  # USE
    """,
    "a test comparing the rank": """
        def step(x, rank, world_size):
            if rank > 0:  # ROLE
                for _ in range(rank):
                    dist.recv(x, src=rank - 1)  # USE
    """,
}
VALUES = {
    "a module built for the last stage": """
        class Stack:
            def __init__(self, head=True):
                self.head = Linear(8, 1) if head else None

            def forward(self, x):
                return x if self.head is None else self.head(x)  # USE

        def distributed(rank, world_size):
            return Stack(head=rank == world_size - 1)  # ROLE
    """,
}
FINE = {
    "a send no test guards": """
        def ring(x, rank, world_size, wrap):
            dist.send(x, (rank + 1) % world_size if wrap else rank + 1)  # USE
    """,
    "a guard that compares no rank": """
        class Stage:
            def __init__(self, rank, training):
                self.rank, self.training = rank, training

            def forward(self, x):
                if self.training:
                    dist.send(x, self.rank + 1)  # USE

        def distributed(rank, world_size):
            return Stage(rank, True)
    """,
    "a test of the data": """
        def step(x, rank):
            if x.numel() > 0:
                dist.send(x, rank + 1)  # USE
    """,
}


def _lines(tmp_path: Path, source: str) -> tuple[str, dict[str, int]]:
    text = textwrap.dedent(source)
    path = tmp_path / "program.py"
    path.write_text(text)
    marks = {mark: number for number, line in enumerate(text.splitlines(), 1) for mark in ("USE", "ROLE")
             if line.endswith(f"# {mark}")}
    return str(path), marks


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_comparison_that_gave_the_rank_its_role_is_found_from_its_send(tmp_path: Path, name: str) -> None:
    path, marks = _lines(tmp_path, PROGRAMS[name])
    choice = role_choice(path, marks["USE"])
    assert choice is not None and (choice.line, choice.what) == (marks["ROLE"], ROLE), choice


@pytest.mark.parametrize("name", VALUES)
def test_the_comparison_that_chose_a_value_is_found_only_when_values_are_asked_for(tmp_path: Path, name: str) -> None:
    path, marks = _lines(tmp_path, VALUES[name])
    choice = role_choice(path, marks["USE"], values=True)
    assert choice is not None and choice.line == marks["ROLE"], choice
    assert role_choice(path, marks["USE"]) is None  # no `if` decides whether the line runs


@pytest.mark.parametrize("name", FINE)
def test_no_role_where_no_comparison_of_the_rank_decides(tmp_path: Path, name: str) -> None:
    path, marks = _lines(tmp_path, FINE[name])
    assert role_choice(path, marks["USE"]) is None


@pytest.mark.parametrize(("peer", "neighbour"), [
    ("rank + 1", True), ("self.rank - 1", True), ("1 + tp_rank", True),
    ("1", False), ("(rank + 1) % world_size", False), ("rank + 2", False), ("0 + 1", False), ("rank * 2", False),
])
def test_a_neighbour_is_a_rank_plus_or_minus_one(tmp_path: Path, peer: str, neighbour: bool) -> None:
    path, _ = _lines(tmp_path, f"dist.send(x, dst={peer})\n")
    assert neighbour_peer(path, 1) is neighbour

