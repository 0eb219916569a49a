"""Row-invariant matmuls: a token row's bits independent of how many rows share its product,
and the probes that find, on the running backend, the block size that makes it so.

A jitted `[M, d] @ [d, f]` does not give a row the same bits at every row count M: XLA
picks its kernel by shape. Measured on XLA CPU (jax 0.10.2) for ten shapes of the bench
model and of SmolLM2-135M, the row bits fall into classes by M: {1} (a matrix-vector
kernel), {2..32} (one class for every shape), and {33+} (for most shapes; for the
1408 -> 512 and 1536 -> 576 down projections the class {2..256} goes on). So a product
whose every dot has between 2 and `block` rows, `block` inside the class, gives each row
the same bits whatever M and wherever the row sits: `invariant_matmul` pads a single row to
two, runs up to `block` rows as one dot, and more as a loop (`lax.map`) over `block`-row
dots (a dot inside the loop has the bits of the same dot alone). `invariant_block` probes
the largest such block for a shape; `row_classes` which row counts change a plain row.

Legend: M rows, d input width, f output width, B block rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

BLOCKS = (2, 4, 8, 16, 32, 64, 128, 256)  # the block sizes `invariant_block` considers


@partial(jax.jit, static_argnames=("block",))
def invariant_matmul(x: jax.Array, w: jax.Array, block: int) -> jax.Array:
    """x [..., d] @ w [d, ...] with every dot between 2 and `block` rows (see the module
    docstring); leading axes of x are flattened into rows and trailing axes of w into
    columns (a DenseGeneral kernel [D, N, H] works as is)."""
    lead, d, trail = x.shape[:-1], x.shape[-1], w.shape[1:]
    rows = x.reshape(-1, d)  # [M, d]
    w2 = w.reshape(d, math.prod(trail))  # [d, f]
    m = rows.shape[0]
    if m <= block:  # one dot of max(M, 2) rows
        out = (jnp.pad(rows, ((0, max(2 - m, 0)), (0, 0))) @ w2)[:m]
    else:  # [n, B, d] blocks, the last one zero-padded
        n = -(-m // block)
        blocks = jnp.pad(rows, ((0, n * block - m), (0, 0))).reshape(n, block, d)
        out = jax.lax.map(lambda b: b @ w2, blocks).reshape(n * block, -1)[:m]  # [M, f]
    return out.reshape(*lead, *trail)


def plain_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, d] @ w [d, f], as XLA chooses to compute it (the reference)."""
    return x @ w


def _probe_inputs(d: int, f: int, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((rows, d)).astype(np.float32)),
            jnp.asarray(rng.standard_normal((d, f)).astype(np.float32)))


def row_classes(matmul: Callable[[jax.Array, jax.Array], jax.Array], d: int, f: int,
                sizes: Sequence[int] = (1, 2, 3, 8, 16, 32, 33, 48, 64, 128, 256),
                seed: int = 0) -> list[int]:
    """The row counts M at which a row's bits differ from the same row computed alone
    (M = 1), checked for the first and the last row of each M: empty when the matmul is
    row-invariant on this backend at this shape."""
    x, w = _probe_inputs(d, f, max(sizes), seed)
    fn = jax.jit(matmul)
    alone = {i: np.asarray(fn(x[i:i + 1], w))[0] for i in {0, *[m - 1 for m in sizes]}}
    differ = []
    for m in sizes:
        out = np.asarray(fn(x[:m], w))
        if not (np.array_equal(out[0], alone[0]) and np.array_equal(out[m - 1], alone[m - 1])):
            differ.append(m)
    return differ


def invariant_block(d: int, f: int, blocks: Sequence[int] = BLOCKS, seed: int = 0) -> int:
    """The largest block B such that plain dots of 2, 3, ... B rows (the sizes in `blocks`
    and the ones just below them) give their first two rows and their last row the bits
    those rows have in a 2-row dot; 2 when only pairs agree."""
    x, w = _probe_inputs(d, f, max(blocks), seed)
    fn = jax.jit(plain_matmul)
    pair = np.asarray(fn(x[:2], w))
    rows = {}
    best = 2
    for b in sorted(blocks):
        for m in sorted({b - 1, b} - {1}):
            out = np.asarray(fn(x[:m], w))
            last = rows.setdefault(m - 1, np.asarray(fn(jnp.stack([x[m - 2], x[m - 1]]), w))[1])
            if not (np.array_equal(out[:2], pair) and np.array_equal(out[m - 1], last)):
                return best
        best = b
    return best


def model_shapes(config) -> dict[str, tuple[int, int]]:
    """The (d, f) of every token-row matmul of a `ModelConfig`'s layers and head."""
    c = config
    return {"q": (c.d_model, c.num_heads * c.head_dim),
            "k/v": (c.d_model, c.num_kv_heads * c.head_dim),
            "o": (c.num_heads * c.head_dim, c.d_model),
            "mlp up": (c.d_model, c.d_ff), "mlp down": (c.d_ff, c.d_model),
            "head": (c.d_model, c.vocab_size)}
