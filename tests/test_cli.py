"""The command line: exit codes, JSON report, and clear messages for unusable input."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
import torch

from shardproof import verify
from shardproof.cli import main
from shardproof.errors import CaseError

CASES = Path(__file__).parent / "cases"
MLP = '''
import torch, torch.distributed as dist

class MLP(torch.nn.Module):
    def __init__(self, hidden=8, ffn=16):
        super().__init__()
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

def reference():
    return MLP()

def distributed(rank, world_size):
    return MLP(ffn=16 // world_size)

def shard_state(ref, rank, n):
    return {"up.weight": ref["up.weight"].chunk(n, 0)[rank], "down.weight": ref["down.weight"].chunk(n, 1)[rank]}

def inputs():
    return (torch.randn(2, 8),)
'''

REDUCED = MLP.replace("return self.down(torch.relu(self.up(x)))",
                      "y = self.down(torch.relu(self.up(x)))\n        if dist.is_initialized():\n            dist.all_reduce(y)\n        return y")


def _line_of(text: str, start: str) -> int:
    """The number of the case file's line that starts (after indentation) with `start`."""
    return next(i for i, line in enumerate(textwrap.dedent(text).splitlines(), 1) if line.strip().startswith(start))


def _case(tmp_path: Path, text: str) -> str:
    path = tmp_path / "case.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_equivalent_writes_the_json_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.json"
    code = main(["verify", str(CASES / "row-bias-before-reduce_fixed.py"), "--json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    assert code == 0 and report["verdict"] == "equivalent"
    assert report["world_size"] == 2 and report["discrepancy"] is None and report["unknown"] is None
    assert report["reference_ops"] > 0 and report["distributed_ops"] > report["reference_ops"]
    assert "equivalent" in capsys.readouterr().out


def test_discrepancy_json_lists_the_culprit_first(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    path = CASES / "row-bias-before-reduce_buggy.py"
    code = main(["verify", str(path), "--json", str(out), "--quiet"])
    found = json.loads(out.read_text())["discrepancy"]
    assert code == 1
    first = found["distributed"][0]
    assert Path(first["file"]).name == path.name and "BUG" in first["code"] and first["rank"] in (0, 1)
    assert "double counting" in found["diagnosis"] and found["claims"] == ["output 0"]


def test_missing_all_reduce_in_a_new_case_is_found(tmp_path: Path, capsys) -> None:
    """A model never seen before: the row-parallel partial sum is returned unreduced."""
    assert main(["verify", _case(tmp_path, MLP), "--quiet"]) == 1
    out = capsys.readouterr().out
    line = _line_of(MLP, "return self.down")
    assert "missing reduction" in out
    assert f"fix: all-reduce `self.down(torch.relu(self.up(x)))` over ranks [0, 1] after line {line} of case.py" in out


def test_the_same_case_with_its_all_reduce_is_proven(tmp_path: Path) -> None:
    assert main(["verify", _case(tmp_path, REDUCED), "--quiet", "--world-size", "4"]) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("def reference(:\n", "syntax error"),
        ("import torch\ndef reference(): return torch.nn.Linear(2, 2)\n", "missing required function"),
        (MLP.replace("return (torch.randn(2, 8),)", "return (torch.randn(2, 9),)"), "tracing the reference model failed"),
        (MLP.replace("return MLP(ffn=16 // world_size)", "raise RuntimeError('no such layer')"), "no such layer"),
        (MLP.replace("return MLP(ffn=16 // world_size)", "MLP(ffn=16 // world_size)"),
         "distributed(0, 2) returned None; it must return the model"),
        (MLP.replace("return (torch.randn(2, 8),)", "return torch.randn(2, 8)"), "inputs() returned a tensor; it must return a tuple"),
        (MLP.replace("return self.down(torch.relu(self.up(x)))", "return self.down(torch.relu(self.up(x))) / x.abs().max().item()"),
         f"case.py:{_line_of(MLP, 'return self.down')}  return self.down(torch.relu(self.up(x))) / x.abs().max().item()\n"
         "  what to do: the model reads a tensor's value"),
        (MLP.replace("return self.down(torch.relu(self.up(x)))", "if x.sum() > 0:\n            x = -x\n        return self.down(x)"),
         f"case.py:{_line_of(MLP, 'return self.down')}  if x.sum() > 0:\n  what to do: the model reads a tensor's value"),
    ],
    ids=["syntax-error", "missing-function", "shape-mismatch", "model-raises", "no-model", "inputs-not-a-tuple", "item",
         "data-dependent-if"],
)
def test_unusable_input_exits_2_with_a_message(tmp_path: Path, capsys, caplog, text: str, message: str) -> None:
    assert main(["verify", _case(tmp_path, text), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # torch logs no traceback of its own


PIPELINING = '''
import torch
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

MODE = "train"

class Stage(torch.nn.Linear):
    def forward(self, x, *targets):
        return super().forward(x)

def reference():
    return Stage(4, 4)

def distributed(rank, world_size):
    return Stage(4, 4)

def inputs():
    return torch.randn(4, 4), torch.randn(4, 4)

def loss(output, x, target):
    return ((output - target) ** 2).mean()

def distributed_step(model, inputs, rank, world_size):
    x, target = inputs
    schedule = ScheduleGPipe(PipelineStage(model, rank, world_size, torch.device("cpu")), 2, loss_fn=torch.nn.MSELoss())
    losses = []
    schedule.step(x, target=target, losses=losses)
    return sum(losses)
'''


def test_a_value_read_inside_a_torch_library_names_its_line(tmp_path: Path, capsys) -> None:
    """torch.distributed.pipelining's schedules read a vote received from the other stages with
    `.item()` before the first microbatch: unusable input, located at the user's call and the
    library's line."""
    assert main(["verify", _case(tmp_path, PIPELINING), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "schedule.step(x, target=target, losses=losses)\n  inside torch/distributed/pipelining/schedules.py:" in err
    assert ".item()" in err.split("\n  inside ", 1)[1].splitlines()[0]


def test_missing_file_exits_2(capsys) -> None:
    assert main(["verify", "no/such/case.py", "--quiet"]) == 2
    assert "case file not found" in capsys.readouterr().err


@pytest.mark.parametrize("op", ["sort(0).values", "msort()", "cummax(0).values"])
def test_an_op_working_column_by_column_is_proven_on_column_shards(op: str, tmp_path: Path, capsys) -> None:
    """Sorting (or a running max down) each column commutes with taking a rank's columns: no rule
    names these ops, DTensor's sharding tables say they work along one dim, and that one law
    (relations/rules/blocks.py) proves them; the numbers agree."""
    from shardproof.case import load_case
    from shardproof.oracle import run_numeric

    body = f"y = self.down(torch.relu(self.up(x)).{op})\n        if dist.is_initialized():\n            dist.all_reduce(y)\n        return y"
    path = _case(tmp_path, MLP.replace("return self.down(torch.relu(self.up(x)))", body))
    assert main(["verify", path, "--quiet"]) == 0
    assert run_numeric(load_case(path), 2).agree


@pytest.mark.parametrize("world_size", ["0", "-2", "two"])
def test_a_world_size_that_is_no_positive_number_is_refused(world_size: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["verify", str(CASES / "row-bias-before-reduce_fixed.py"), "--world-size", world_size])
    assert exit.value.code == 2 and "--world-size" in capsys.readouterr().err


def test_the_api_refuses_a_world_size_of_zero() -> None:
    with pytest.raises(CaseError, match="at least 1"):
        verify(CASES / "row-bias-before-reduce_fixed.py", world_size=0)


def test_a_size_the_world_size_does_not_divide_is_named(tmp_path: Path, capsys) -> None:
    """Without shard_state the default loader cannot cut 16 rows in 3; with a loader that takes
    16 // 3 rows each, one row is lost: a real discrepancy, whose likelier fix is the world size."""
    unloaded = MLP[: MLP.index("def shard_state")] + MLP[MLP.index("def inputs") :]
    assert main(["verify", _case(tmp_path, unloaded), "--quiet", "--world-size", "3"]) == 2
    built = _line_of(unloaded, "self.up = ")
    assert f"16 (dim 0) is not divisible by world size 3 (built at case.py:{built})" in capsys.readouterr().err
    narrowed = REDUCED.replace('return {"up.weight": ref["up.weight"].chunk(n, 0)[rank], "down.weight": ref["down.weight"].chunk(n, 1)[rank]}',
                               'k = 16 // n\n    return {"up.weight": ref["up.weight"][rank * k:(rank + 1) * k], '
                               '"down.weight": ref["down.weight"][:, rank * k:(rank + 1) * k]}')
    assert main(["verify", _case(tmp_path, narrowed), "--quiet", "--world-size", "3"]) == 1
    line = _line_of(narrowed, 'return {"up.weight"')
    assert f"size 16 of `up.weight` (dim 0) is not divisible by world size 3: each rank takes 5 at case.py:{line}" in capsys.readouterr().out


def test_a_directory_given_as_the_case_is_named_as_one(tmp_path: Path, capsys) -> None:
    assert main(["verify", str(tmp_path), "--quiet"]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["missing/out.json", "."], ids=["missing-directory", "a-directory"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path, capsys, target: str) -> None:
    assert main(["verify", str(CASES / "row-bias-before-reduce_fixed.py"), "--json", str(tmp_path / target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--json" in err  # nothing was proven (and printed) first


def test_what_the_model_prints_stays_off_the_report(tmp_path: Path, capfd) -> None:
    """stdout carries the report alone, whatever the model prints while it is traced and run."""
    text = MLP.replace("return self.down(torch.relu(self.up(x)))", "print('hidden', x)\n        return self.down(torch.relu(self.up(x)))")
    assert main(["verify", _case(tmp_path, text), "--quiet"]) == 1  # it is still the buggy MLP: run numerically too
    out, err = capfd.readouterr()
    assert out.startswith("discrepancy: missing reduction") and "hidden" not in out
    assert "hidden" in err


def test_an_internal_error_exits_3_in_one_line(monkeypatch, capsys) -> None:
    def broken(*args, **kwargs):
        raise KeyError("term 42")

    monkeypatch.setattr("shardproof.driver.prove", broken)
    case = str(CASES / "row-bias-before-reduce_fixed.py")
    assert main(["verify", case, "--quiet"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "internal error while proving: KeyError: 'term 42'" in err and "bug in shardproof" in err and "--debug" in err
    assert main(["verify", case, "--quiet", "--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_a_numeric_run_that_fails_is_never_a_discrepancy(monkeypatch, capsys) -> None:
    """The oracle raising (here: always) cannot confirm a wrong-layout finding: unknown, exit 2."""
    def broken(*args, **kwargs):
        raise RuntimeError("expected scalar type Float but found Double")

    monkeypatch.setattr("shardproof.api.run_numeric", broken)
    assert main(["verify", str(CASES / "qkv-gqa-offset_buggy.py"), "--quiet"]) == 2
    assert "the numeric run failed: RuntimeError: expected scalar type Float" in capsys.readouterr().out


def test_version_and_module_entry_point() -> None:
    for command in (["--version"], ["--help"]):
        done = subprocess.run([sys.executable, "-m", "shardproof", *command], capture_output=True, text=True, check=True)
        assert "shardproof" in done.stdout
    assert subprocess.run([sys.executable, "-m", "shardproof", "--version"], capture_output=True, text=True).stdout.strip() \
        == f"shardproof {metadata.version('shardproof')}"


def test_graph_dumps_that_do_not_exist_are_named_before_any_work(tmp_path: Path, capsys) -> None:
    (tmp_path / "ref.hlo").write_text("HloModule m\n")
    args = ["verify-graphs", "--reference", str(tmp_path / "ref.hlo"), "--distributed", str(tmp_path / "ranks")]
    assert main(args) == 2 and f"--distributed {tmp_path / 'ranks'}: not found" in capsys.readouterr().err
    assert main([*args[:3], "--distributed", str(tmp_path), "--relations", "pins.json"]) == 2
    assert "--relations pins.json: not found" in capsys.readouterr().err


EMBEDDING = '''
import torch, torch.distributed as dist, torch.nn.functional as F

VOCAB, WIDTH = 16, 4

class Embedding(torch.nn.Module):
    def __init__(self, rows=VOCAB):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, WIDTH))

    def forward(self, ids):
        return F.embedding(ids, self.weight)

class VocabParallelEmbedding(Embedding):
    def __init__(self, rank, world_size):
        super().__init__(VOCAB // world_size)
        self.start, self.end = rank * (VOCAB // world_size), (rank + 1) * (VOCAB // world_size)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = (self.start - ids).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        dist.all_reduce(rows)
        return rows

def reference():
    return Embedding()

def distributed(rank, world_size):
    return VocabParallelEmbedding(rank, world_size)

def inputs():
    return (torch.arange(VOCAB).view(2, 8),)
'''


def test_a_program_that_raises_when_run_exits_2_naming_the_rank_and_line(tmp_path: Path, capsys) -> None:
    """Ids shifted the wrong way (start - id): the ranks look up negative rows. The proof finds the
    fault, the numeric run fails: unusable input, with the rank and the line, never a traceback."""
    assert main(["verify", _case(tmp_path, EMBEDDING), "--quiet"]) == 2
    err = capsys.readouterr().err
    line = _line_of(EMBEDDING, "rows = F.embedding")
    assert f"the program raises on rank 0 at case.py:{line}" in err and "IndexError" in err, err
    assert "Traceback" not in err


def test_a_model_failing_on_one_rank_is_unusable_input_naming_rank_and_line(tmp_path: Path, capsys) -> None:
    text = MLP.replace("return self.down(torch.relu(self.up(x)))", "assert self.up.out_features != 8, 'rank two'\n        return self.down(torch.relu(self.up(x)))")
    assert main(["verify", _case(tmp_path, text), "--quiet"]) == 2
    err = capsys.readouterr().err
    line = _line_of(text, "assert self.up")
    assert "tracing rank 0 failed: AssertionError: rank two" in err and f"case.py:{line}" in err and "Traceback" not in err


def test_an_internal_error_while_tracing_exits_3_in_one_line(monkeypatch, capsys) -> None:
    """A bug in shardproof's own code on the tracing path is no fault of the model's."""
    monkeypatch.setattr(torch.autograd, "_get_sequence_nr", {}.popitem)  # KeyError, raised in shardproof's frame
    assert main(["verify", str(CASES / "ddp-sync-flag-late_fixed.py"), "--quiet", "--train"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "failed in shardproof (capture/locations.py:" in err and "KeyError: 'popitem(): dictionary is empty'" in err
    assert "bug in shardproof" in err
