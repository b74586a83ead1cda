"""Which aten ops the traces of examples/ and tests/realworld/'s models reach, and how the lowering
handles each: the category is read off what `Lowerer` does with the op while it lowers the real
traces (which of its paths the call takes, which IR ops it emits), not kept by hand.

  decomposed (torch)   torch's decomposition tables broke it into smaller ops (listed on their own rows)
  decomposed (ours)    a hand lowering spells it with several IR ops of ours
  own rules            a hand lowering maps it onto one IR op of ours (or onto none: a view of metadata)
  pointwise tag        an open op torch tags pointwise: the elementwise layout laws
  tag: <kind>          an open op of another tag-derived kind (reduction, leading dims, random draw)
  congruence only      an open op no tag describes: equal only to itself on equal arguments
  no rule              the lowering refused it (the trace failed)

A row lists every route the op took (arguments can change it: argmax over a dim is our op, over
the flattened tensor an open op). Each model is traced at world size 2, reference and ranks,
forward (unless the case defines its own training step: its rank model may be one stage) and in
training where the model has a loss, in this process (nothing is proven).

    python bench/op_coverage.py [--only examples,sampling,transformers,torchtitan,megatron] [--case case.py ...]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("examples", "sampling", "transformers", "torchtitan", "megatron")
TRANSFORMERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere",
                "granite", "starcoder2", "gpt_neox", "mixtral", "qwen3_moe", "deepseek_v3"]  # tests/realworld/test_transformers.py
NO_RULE = "no rule"


class Routes:
    """What the lowering did with each op: op name -> route -> IR ops emitted, and who reached it."""

    def __init__(self) -> None:
        self.routes: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.models: dict[str, set[str]] = defaultdict(set)
        self.pieces: dict[str, set[str]] = defaultdict(set)  # op -> the ops whose decomposition holds it
        self.model = ""
        self._stack: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Observe `Lowerer.call` (the op's way through the lowering) and the two ways out of a hand
        lowering: torch's decomposition (`inlined`) and the open op (`open_call`)."""
        from shardproof.ir import from_fx

        lowerer = from_fx.Lowerer
        call, inlined, open_call = lowerer.call, lowerer.inlined, lowerer.open_call
        routes = self

        def watched_call(self: Any, node: Any) -> Any:
            name = _op_name(node.target)
            if name is None:
                return call(self, node)
            frame = {"name": name, "decomposed": False, "open": False}
            before = len(self.graph.nodes)
            routes._stack.append(frame)
            try:
                result = call(self, node)
            except Exception:
                routes.note(name, NO_RULE, set())
                raise
            finally:
                routes._stack.pop()
            emitted = {n.op for n in self.graph.nodes[before:]} - {"const"}
            routes.note(name, routes.route(frame, name, emitted), emitted)
            return result

        def watched_inlined(self: Any, node: Any, target: Any, *args: Any) -> Any:
            if routes._stack:
                routes._stack[-1]["decomposed"] = True
                parent = routes._stack[-1]["name"]
                for inner in args[0].graph.nodes:
                    if _op_name(inner.target) is not None:
                        routes.pieces[_op_name(inner.target)].add(parent)
            return inlined(self, node, target, *args)

        def watched_open_call(self: Any, target: Any, *args: Any) -> Any:
            if routes._stack:
                routes._stack[-1]["open"] = True
            return open_call(self, target, *args)

        with mock.patch.object(lowerer, "call", watched_call), mock.patch.object(lowerer, "inlined", watched_inlined), \
                mock.patch.object(lowerer, "open_call", watched_open_call):
            yield

    def route(self, frame: dict[str, Any], name: str, emitted: set[str]) -> str:
        from shardproof.ir import aten_ops

        if frame["decomposed"]:
            return "decomposed (torch)"
        if frame["open"] and name in emitted:
            kind = aten_ops.kind(name)
            return {"pointwise": "pointwise tag", "opaque": "congruence only"}.get(kind, f"tag: {kind}")
        computing = {op for op in emitted if op not in ("view", "expand", "slice", "permute", "cat", "convert")}
        return "decomposed (ours)" if len(computing) > 1 else "own rules"

    def note(self, name: str, route: str, emitted: set[str]) -> None:
        self.routes[name][route] |= emitted
        self.models[name].add(self.model)


def _op_name(target: Any) -> str | None:
    """`aten.mm.default` for a torch operator overload (any namespace), None for anything else."""
    import torch

    from shardproof.ir.aten_ops import name_of

    return name_of(target) if isinstance(target, torch._ops.OpOverload) else None


def _cases(only: set[str], extra: list[str]) -> Iterator[tuple[str, Callable[[], Any], tuple[str, ...]]]:
    """(model name, a function building its case, the modes to trace)."""
    from shardproof.case import load_case

    for path in extra:
        yield path, lambda path=path: load_case(path), ("forward", "train")
    if "examples" in only:
        for path in sorted((ROOT / "examples").glob("*.py")):
            if "def distributed(" in path.read_text():
                yield f"examples/{path.name}", lambda path=path: load_case(path), ("forward", "train")
    if "sampling" in only:
        for path in sorted((ROOT / "tests" / "cases").glob("*_fixed.py")):
            if path.name.startswith(("greedy-argmax", "logits-buffer")):  # tests/realworld/test_sampling.py
                yield f"tests/cases/{path.name}", lambda path=path: load_case(path), ("forward",)
    if "transformers" in only and _importable("transformers"):
        from shardproof.integrations.transformers import tiny_config, transformers_case

        for arch in TRANSFORMERS:
            for mode in ("forward", "train"):
                yield (f"transformers/{arch}", lambda arch=arch, mode=mode: transformers_case(
                    tiny_config(arch), world_size=2, train=mode == "train"), (mode,))
    if "torchtitan" in only and _importable("torchtitan"):
        from shardproof.integrations.torchtitan import tiny_config, torchtitan_case

        for model in ("llama3", "qwen3"):
            for mode, attention in (("forward", "flex"), ("train", "sdpa")):  # as tests/realworld/test_torchtitan.py
                yield (f"torchtitan/{model}", lambda model=model, mode=mode, attention=attention: torchtitan_case(
                    tiny_config(model, sequence_parallel=True, attention=attention), 2, mode=mode), (mode,))
    if "megatron" in only and _importable("megatron.core"):
        from shardproof.integrations.megatron import megatron_gpt_case, tiny_config

        for mode in ("forward", "train"):
            yield ("megatron/gpt", lambda mode=mode: megatron_gpt_case(tiny_config(sequence_parallel=True), 32, 2, mode=mode),
                   (mode,))


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        print(f"# {module} is not installed: its models are left out", file=sys.stderr)
        return False
    return True


def _defines(case: Any, mode: str) -> bool:
    """Whether the case defines a program in `mode`: a case with its own training step (a pipeline
    schedule, FSDP's hooks) defines none in forward mode, where its rank model alone may be a stage."""
    if mode == "forward":
        return case.distributed_step is None
    return case.mode != "forward" or case.loss is not None or case.distributed_step is not None


def collect(only: set[str], extra: list[str] = ()) -> tuple[Routes, list[str]]:
    """Trace every model of the chosen sources under observation; also the traces that failed."""
    from shardproof.capture.torch_capture import capture

    routes, failures = Routes(), []
    with routes.watching():
        for model, build, modes in _cases(only, list(extra)):
            for mode in modes:
                routes.model = f"{model} {mode}"
                try:
                    case = build()
                    if not _defines(case, mode):
                        continue
                    with case.importable():
                        capture(case, 2, mode=mode)
                except Exception as err:  # noqa: BLE001 - a failed trace is a row of the report, not the end of it
                    failures.append(f"{model} {mode}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
    return routes, failures


def table(routes: Routes) -> list[str]:
    rows = []
    for name in sorted(routes.routes, key=lambda n: (sorted(routes.routes[n]), n)):
        by_route = routes.routes[name]
        how = "; ".join(sorted(by_route))
        ours = sorted(set().union(*by_route.values()) - {name})
        inside = f" (inside {', '.join(sorted(routes.pieces[name]))})" if routes.pieces.get(name) else ""
        rows.append(f"| `{name}` | {how} | {', '.join(ours) or '-'} | {len(routes.models[name])}{inside} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SOURCES), help=f"comma-separated sources among {', '.join(SOURCES)}")
    parser.add_argument("--case", action="append", default=[], help="a case file of your own to trace too")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    routes, failures = collect(only, args.case)
    print("| aten op | handled as | IR ops it becomes | models (traces) reaching it |")
    print("|---|---|---|---|")
    print("\n".join(table(routes)))
    counts: dict[str, int] = defaultdict(int)
    for by_route in routes.routes.values():
        for route in by_route:
            counts[route] += 1
    print(f"\n{len(routes.routes)} ops in {len({m for ms in routes.models.values() for m in ms})} traces "
          f"({time.perf_counter() - start:.0f} s): " + ", ".join(f"{route} {n}" for route, n in sorted(counts.items())))
    for failure in failures:
        print(f"trace failed: {failure}")
    return 1 if NO_RULE in counts or failures else 0


if __name__ == "__main__":
    sys.exit(main())
