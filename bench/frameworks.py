"""Frameworks' own tensor parallelism through shardproof.integrations: one row per framework,
architecture, mode and world size, each verified in a fresh Python process (`python -c`), so the
wall time includes starting Python and importing torch and the framework, and the peak memory is
that process's own. The CPU seconds (user + system) of that process are printed beside the wall time:
on a loaded machine they say what the wall time would be on an idle one, as nearly all the work is
on one thread.

Rows: every transformers architecture of tests/realworld/test_transformers.py from its tiny config,
torchtitan's llama3 and qwen3 (TP+SP), Megatron-Core's GPTModel (TP+SP), forward at world sizes 2
and 8; and Llama-3.1-8B's real config (built in code, nothing downloaded) through transformers'
own TP at world size 8. Fake tensors throughout: no weights are allocated at any size.

`run cpu s` is the CPU seconds of the cold process after its imports (building the case and
verifying it): what a warm run costs, and its wall time on an idle machine. `--warm` adds a column:
the same row run as `shardproof verify` on a case file (`CASE = ...`) while `shardproof serve`
runs, so the imports are done before the command starts (the wall time a user sees from the
second run on).

    python bench/frameworks.py [--only transformers,torchtitan,megatron,llama-8b] [--world-sizes 2,8] [--train] [--warm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

WORLD_SIZES = (2, 8)
TRANSFORMERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere",
                "granite", "starcoder2", "gpt_neox", "mixtral", "qwen3_moe", "deepseek_v3"]
TARGETS = {"tiny": 5.0, "llama-8b": 30.0}  # wall seconds at world size 8 (issue 11, acceptance 4)

# Llama-3.1-8B's config.json, as a config object
LLAMA_8B = """LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, dtype="bfloat16")"""

BUILD = {
    "transformers": "from transformers import LlamaConfig\n"
                    "from shardproof.integrations.transformers import tiny_config, transformers_case\n"
                    "config = {config}\n"
                    "case = transformers_case(config, world_size={n}, train={train})",
    "torchtitan": "from shardproof.integrations.torchtitan import tiny_config, torchtitan_case\n"
                  "case = torchtitan_case(tiny_config({arch!r}, sequence_parallel=True, attention={attention!r}), {n}, "
                  "mode={mode!r})",
    "megatron": "from shardproof.integrations.megatron import megatron_gpt_case, tiny_config\n"
                "case = megatron_gpt_case(tiny_config(sequence_parallel=True), 32, {n}, mode={mode!r})",
}
MEASURE = """
import json, resource, time, warnings
warnings.filterwarnings("ignore")
from shardproof import verify
{imports}
imported = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
{build}
report = verify(case, world_size={n}, train={train})
cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
print("RESULT " + json.dumps({{"verdict": report.verdict, "reference_ops": report.reference_ops,
    "distributed_ops": report.distributed_ops, "proof_seconds": report.seconds - report.capture_seconds,
    "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "cpu_seconds": cpu, "run_cpu_seconds": cpu - imported,
    "note": str(report.diagnosis or report.unknown or "")[:160]}}))
"""


def rows(only: set[str], world_sizes: list[int], train: bool) -> list[tuple[str, str, int, str]]:
    """(framework, architecture, world size, the program building the case)."""
    mode = "train" if train else "forward"
    out = []
    for n in world_sizes:
        if "transformers" in only:
            out += [("transformers", arch, n, BUILD["transformers"].format(config=f"tiny_config({arch!r})", n=n, train=train))
                    for arch in TRANSFORMERS]
        if "torchtitan" in only:
            attention = "sdpa" if train else "flex"  # FlexAttention's backward refuses the CPU
            out += [("torchtitan", arch, n, BUILD["torchtitan"].format(arch=arch, n=n, attention=attention, mode=mode))
                    for arch in ("llama3", "qwen3")]
        if "megatron" in only:
            out.append(("megatron", "gpt", n, BUILD["megatron"].format(n=n, mode=mode)))
    if "llama-8b" in only:
        out.append(("transformers", "llama-3.1-8b", 8, BUILD["transformers"].format(config=LLAMA_8B, n=8, train=train)))
    return out


def measure(build: str, n: int, train: bool, timeout: float) -> dict:
    """Verify in a fresh process; its wall time seen from here."""
    start = time.perf_counter()
    try:
        imports, rest = _imports_first(build)
        done = subprocess.run([sys.executable, "-c", MEASURE.format(imports=imports, build=rest, n=n, train=train)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"verdict": "timeout", "wall": timeout, "note": f"no result within {timeout:.0f} s"}
    wall = time.perf_counter() - start
    result = next((line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"verdict": "error", "wall": wall, "note": last[:160]}
    return {**json.loads(result), "wall": wall}


def _imports_first(build: str) -> tuple[str, str]:
    """A row's program as its imports (what `shardproof serve` has done before a command starts)
    and the rest (building the case)."""
    lines = build.splitlines()
    imports = [line for line in lines if line.startswith(("from ", "import "))]
    return "\n".join(imports), "\n".join(line for line in lines if line not in imports)


@contextlib.contextmanager
def warm_server() -> Iterator[tuple[dict, Path]]:
    """A `shardproof serve` of this interpreter on a socket of its own; the environment reaching it
    and a folder for the rows' case files."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "SHARDPROOF_SOCKET": f"{folder}/s.sock"}
        env.pop("SHARDPROOF_NO_SERVER", None)
        server = subprocess.Popen([sys.executable, "-m", "shardproof", "serve"], env=env, stderr=subprocess.DEVNULL)
        try:
            while not Path(folder, "s.sock").exists():
                if server.poll() is not None:
                    raise RuntimeError("shardproof serve stopped before it listened")
                time.sleep(0.2)
            yield env, Path(folder)
        finally:
            server.terminate()
            server.wait()


def measure_warm(build: str, n: int, train: bool, timeout: float, env: dict, folder: Path) -> dict:
    """The row as a case file verified through the warm server; its wall time seen from here."""
    case, report = folder / "row_case.py", folder / "row.json"
    case.write_text(f"{build}\nCASE = case\n")
    report.unlink(missing_ok=True)
    command = [shutil.which("shardproof") or "shardproof", "verify", str(case), "--world-size", str(n), "--quiet",
               "--json", str(report), *(["--train"] if train else [])]
    start = time.perf_counter()
    try:
        subprocess.run(command, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"verdict": "timeout", "wall": timeout}
    wall = time.perf_counter() - start
    return {"verdict": json.loads(report.read_text())["verdict"] if report.exists() else "error", "wall": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="transformers,torchtitan,megatron,llama-8b")
    parser.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)))
    parser.add_argument("--train", action="store_true", help="one training step instead of the forward")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per row")
    parser.add_argument("--warm", action="store_true", help="also time each row through `shardproof serve`")
    args = parser.parse_args(argv)
    with warm_server() if args.warm else contextlib.nullcontext((None, None)) as (env, folder):
        return table(args, env, folder)


def table(args: argparse.Namespace, env: dict | None, folder: Path | None) -> int:
    """Print the table; 1 if a row at world size 8 missed its target (cold, and warm where measured)."""
    print("| framework | architecture | ws | verdict | wall s | warm s | cpu s | run cpu s | proof s | peak MiB | ref ops | dist ops | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes, missed = [], 0
    for framework, arch, n, build in rows(set(args.only.split(",")), [int(w) for w in args.world_sizes.split(",")], args.train):
        print(f"{framework} {arch} ws={n} ...", file=sys.stderr, flush=True)
        got = measure(build, n, args.train, args.timeout)
        warm = None if env is None else measure_warm(build, n, args.train, args.timeout, env, folder)
        if warm is not None and warm["verdict"] != got["verdict"]:
            notes.append(f"{framework} {arch} ws={n}: the warm run says {warm['verdict']}")
        target = TARGETS["llama-8b" if arch.startswith("llama-3.1") else "tiny"] if n == 8 else None
        met = "" if target is None else _met(got, target) + ("" if warm is None else f", warm {_met(warm, target)}")
        missed += "missed" in met
        proof = f"{got['proof_seconds']:.1f}" if "proof_seconds" in got else "-"
        peak = f"{got['peak_mib']:.0f}" if "peak_mib" in got else "-"
        cpu = f"{got['cpu_seconds']:.1f}" if "cpu_seconds" in got else "-"
        run_cpu = f"{got['run_cpu_seconds']:.1f}" if "run_cpu_seconds" in got else "-"
        warm_wall = "-" if warm is None else f"{warm['wall']:.1f}"
        print(f"| {framework} | {arch} | {n} | {got['verdict']} | {got['wall']:.1f} | {warm_wall} | {cpu} | {run_cpu} | {proof} | {peak} | "
              f"{got.get('reference_ops', '-')} | {got.get('distributed_ops', '-')} | {met} |", flush=True)
        if got.get("note"):
            notes.append(f"{framework} {arch} ws={n}: {got['note']}")
    for note in notes:
        print(f"note: {note}")
    return 1 if missed else 0


def _met(got: dict, target: float) -> str:
    return "met" if got["wall"] < target and got["verdict"] == "equivalent" else f"missed ({target:.0f} s)"


if __name__ == "__main__":
    sys.exit(main())
