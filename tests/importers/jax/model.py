"""A Llama-like block in JAX (RMSNorm, GQA attention with RoPE, SwiGLU) written once for the
single-device reference and for its tensor- and sequence-parallel `shard_map` versions: `Comm`
says how ranks talk and does nothing in the reference. The dump tests inject bugs by editing
lines of this file (`bugs.py`), so the sites they expect are lines here."""

import jax
import jax.numpy as jnp

BATCH, SEQ, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN = 2, 8, 16, 8, 4, 4, 32


class Comm:
    """The collectives of a block over mesh axis `axis` (None: one device). Sequence parallel:
    activations between sublayers hold a rank's slice of the sequence."""

    def __init__(self, axis=None, sequence=False):
        self.axis, self.sequence = axis, sequence

    def scatter(self, x):
        if self.axis is None or not self.sequence:
            return x
        chunk = x.shape[1] // jax.lax.axis_size(self.axis)
        start = jax.lax.axis_index(self.axis) * chunk
        return jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)

    def gather(self, x):
        if self.axis is None or not self.sequence:
            return x
        gathered = jax.lax.all_gather(x, self.axis, axis=1)
        return gathered.reshape(x.shape[0], -1, x.shape[2])

    def reduce(self, y):
        if self.axis is None:
            return y
        if self.sequence:
            return jax.lax.psum_scatter(y, self.axis, scatter_dimension=1, tiled=True)
        return jax.lax.psum(y, self.axis)

    def mean(self, value):
        return value if self.axis is None or not self.sequence else jax.lax.pmean(value, self.axis)


def linear(x, w):
    return x @ w


def rms_norm(x, w, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x):
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    angles = jnp.arange(seq)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(x, p, comm):
    b, s, _ = x.shape
    q = linear(x, p["wq"]).reshape(b, s, -1, HEAD_DIM)
    k = linear(x, p["wk"]).reshape(b, s, -1, HEAD_DIM)
    v = linear(x, p["wv"]).reshape(b, s, -1, HEAD_DIM)
    q, k = rope(q), rope(k)
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HEAD_DIM)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, -1)
    return comm.reduce(linear(out, p["wo"]))


def mlp(x, p, comm):
    h = jax.nn.silu(linear(x, p["w_gate"])) * linear(x, p["w_up"])
    return comm.reduce(linear(h, p["w_down"])) + p["b_down"]


def block(x, p, comm):
    x = comm.scatter(x)
    h = x + attention(comm.gather(rms_norm(x, p["attn_norm"])), p, comm)
    out = h + mlp(comm.gather(rms_norm(h, p["mlp_norm"])), p, comm)
    return out


def loss(x, p, comm):
    out = block(x, p, comm)
    return comm.mean(jnp.mean(out * out))
