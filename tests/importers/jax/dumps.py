"""Write the HLO dumps of the JAX block (`model.py`) as XLA writes them, for `verify-graphs`.

`python dumps.py OUT [BUG [PROGRAM ...]]` compiles every program (or those named) on 8 host CPU devices with XLA dumping on and
copies, per program, the module before optimisation (`before.hlo`), after the SPMD partitioner
(`spmd.hlo`, partitioned programs only) and compiled (`compiled.hlo`) to OUT/<program>/. BUG
names an edit of `bugs.py`: the programs then come from `model.py` with that line changed.
Programs: the reference on one device; tensor-parallel (`tp`) and sequence-parallel (`sp`)
`shard_map` programs with explicit collectives; the reference under `jax.jit` with weights laid
out by `NamedSharding` (`jit_tp`, partitioned by XLA); a 2-D mesh (`dp_tp`); each forward and,
with a `_train` suffix, `value_and_grad` of the loss.
"""

import fnmatch
import glob
import importlib.util
import os
import shutil
import sys
import tempfile

STAGES = {"before": "before_optimizations.txt", "spmd": "*.after_spmd-partitioning.*.txt", "compiled": "cpu_after_optimizations.txt"}


def load_model(bug: str | None, out: str):
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "model.py")
    if bug:
        sys.path.insert(0, here)
        from bugs import BUGS

        old, new = BUGS[bug]
        text = open(path).read()
        assert text.count(old) == 1, f"bug {bug}: the line to edit is not in model.py once"
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "model.py")  # kept beside the dumps: their sites point into it
        with open(path, "w") as handle:
            handle.write(text.replace(old, new))
    spec = importlib.util.spec_from_file_location("model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def programs(m, check_vma: bool = True):
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    tp = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,))
    mesh2 = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    col, row = P(None, "tp"), P("tp", None)
    specs = {"attn_norm": P(), "b_down": P(), "mlp_norm": P(), "w_down": row, "w_gate": col, "w_up": col, "wk": col, "wo": row, "wq": col, "wv": col}

    def sharded(fn, mesh, comm, x_spec, out_spec):
        return jax.shard_map(lambda x, p: fn(x, p, comm), mesh=mesh, in_specs=(x_spec, specs), out_specs=out_spec, check_vma=check_vma)

    def train(fn):
        return jax.value_and_grad(lambda p, x: fn(x, p), argnums=0)

    forward = {
        "reference": lambda x, p: m.block(x, p, m.Comm()),
        "tp": sharded(m.block, tp, m.Comm("tp"), P(), P()),
        "sp": sharded(m.block, tp, m.Comm("tp", sequence=True), P(), P(None, "tp")),
        "dp_tp": sharded(m.block, mesh2, m.Comm("tp"), P("dp"), P("dp")),
    }
    training = {
        "reference_train": train(lambda x, p: m.loss(x, p, m.Comm())),
        "tp_train": train(sharded(m.loss, tp, m.Comm("tp"), P(), P())),
        "sp_train": train(sharded(m.loss, tp, m.Comm("tp", sequence=True), P(), P())),
    }
    out = {name: (fn, {}, "xp") for name, fn in forward.items()}
    out.update({name: (fn, {}, "px") for name, fn in training.items()})
    named = {k: NamedSharding(tp, s) for k, s in specs.items()}
    replicated = NamedSharding(tp, P())
    out["jit_tp"] = (forward["reference"], {"in_shardings": (replicated, named), "out_shardings": replicated}, "xp")
    out["jit_tp_train"] = (training["reference_train"], {"in_shardings": (named, replicated)}, "px")
    return out


def named(fn, name: str):
    """`fn` under `name`, which XLA's dump files carry (`module_0003.jit_<name>...`)."""

    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def main(out: str, bug: str | None = None, only: list[str] | None = None) -> None:
    with tempfile.TemporaryDirectory() as work:
        dump = os.path.join(work, "dump")
        os.environ["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count=8 --xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning"
        )
        import jax
        import jax.numpy as jnp

        m = load_model(bug, out)
        x = jax.ShapeDtypeStruct((m.BATCH, m.SEQ, m.DIM), jnp.float32)
        shapes = {"attn_norm": (m.DIM,), "b_down": (m.DIM,), "mlp_norm": (m.DIM,), "w_down": (m.FFN, m.DIM),
                  "w_gate": (m.DIM, m.FFN), "w_up": (m.DIM, m.FFN), "wk": (m.DIM, m.KV_HEADS * m.HEAD_DIM),
                  "wo": (m.HEADS * m.HEAD_DIM, m.DIM), "wq": (m.DIM, m.HEADS * m.HEAD_DIM), "wv": (m.DIM, m.KV_HEADS * m.HEAD_DIM)}  # fmt: skip
        p = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
        # a reduction left out leaves a value JAX's replication check refuses: a user who meets that
        # bug has turned the check off
        for name, (fn, options, order) in programs(m, check_vma=bug is None).items():
            if only and name not in only:
                continue
            args = (x, p) if order == "xp" else (p, x)
            jax.jit(named(fn, name), **options).lower(*args).compile()
            files = glob.glob(os.path.join(dump, f"module_*.jit_{name}.*"))
            for stage, pattern in STAGES.items():
                found = [f for f in files if fnmatch.fnmatch(os.path.basename(f), f"module_*.jit_{name}.{pattern}")]
                if found:
                    os.makedirs(os.path.join(out, name), exist_ok=True)
                    shutil.copy(found[0], os.path.join(out, name, f"{stage}.hlo"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None, sys.argv[3:])
