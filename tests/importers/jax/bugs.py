"""Bugs injected into `model.py`: name -> (the line as written, the line with the bug)."""

BUGS = {
    "missing_psum": ('return comm.reduce(linear(out, p["wo"]))', 'return linear(out, p["wo"])'),
    "bias_before_psum": ('return comm.reduce(linear(h, p["w_down"])) + p["b_down"]', 'return comm.reduce(linear(h, p["w_down"]) + p["b_down"])'),
    "gather_wrong_axis": ("gathered = jax.lax.all_gather(x, self.axis, axis=1)", "gathered = jax.lax.all_gather(x, self.axis, axis=2)"),
    "slice_wrong_offset": ("start = jax.lax.axis_index(self.axis) * chunk", "start = jax.lax.axis_index(self.axis) * chunk + 1"),
    "loss_without_pmean": ("return value if self.axis is None or not self.sequence else jax.lax.pmean(value, self.axis)", "return value"),
}
