"""The parallel examples proven at each world size, forward and trained: verdict, wall and CPU
seconds, peak MiB and memo hits per configuration, each in a fresh spawned child.

`python bench/parallel_examples.py` runs examples/moe_ep.py (presets small and small-etp),
deepseek_v3.py, llama_cp.py, llama_pp.py and llama_fsdp_tp.py at 2, 4, 8 ranks; see bench/README.md.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any

from child import run_in_child
from verify_llama import EXAMPLES, fmt, int_list, render

HEADERS = ["example", "mode", "ws", "verdict", "total s", "cpu s", "peak MiB", "memo hits"]
DEFAULT = ["moe_ep.py", "moe_ep.py:small-etp", "deepseek_v3.py", "llama_cp.py", "llama_pp.py", "llama_fsdp_tp.py"]


def measure(name: str, world_size: int, train: bool) -> dict[str, Any]:
    """Verify one configuration in this process; `name` is `file.py` or `file.py:preset`."""
    from shardproof.api import verify
    from shardproof.case import load_case

    file, _, preset = name.partition(":")
    case = load_case(EXAMPLES / file)
    if preset:
        case.use_preset(preset)
    started = time.process_time()
    report = verify(case, world_size=world_size, train=train)
    calls = report.calls_proven + report.calls_reused
    return {
        "verdict": report.verdict,
        "total": report.seconds,
        "cpu": time.process_time() - started,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "memo": f"{report.calls_reused / calls:.0%} of {calls}" if calls else "-",
    }


def row(name: str, world_size: int, train: bool, timeout: float) -> list[str]:
    status, payload = run_in_child(measure, (name, world_size, train), timeout)
    mode = "train" if train else "forward"
    if status != "ok":
        return [name, mode, str(world_size), status, "-", "-", "-", "-"]
    return [name, mode, str(world_size), payload["verdict"], fmt(payload["total"], ".2f"), fmt(payload["cpu"], ".2f"),
            fmt(payload["peak_mib"], ".0f"), payload["memo"]]


def _own_mode(name: str) -> str:
    from shardproof.case import load_case

    return load_case(EXAMPLES / name.partition(":")[0]).mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="*", default=DEFAULT, help="file.py or file.py:preset, in examples/")
    parser.add_argument("--world-sizes", type=int_list, default=[2, 4, 8])
    parser.add_argument("--modes", default="forward,train", help="forward, train or both")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--markdown", action="store_true", help="emit a markdown table")
    args = parser.parse_args(argv)
    body = []
    for name in args.examples:
        for mode in args.modes.split(","):
            if mode == "forward" and _own_mode(name) != "forward":
                continue  # a case whose program is a training step has no forward of its own
            for world_size in args.world_sizes:
                body.append(row(name, world_size, mode == "train", args.timeout))
                print(" ".join(body[-1]), file=sys.stderr, flush=True)
    print(render(HEADERS, body, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
