"""Row-invariant matmuls: every token row through one fixed tile shape, and a probe that
checks the property on the running backend.

A jitted `[M, d] @ [d, f]` does not give a row the same bits at every row count M: XLA
picks its kernel by shape (on XLA CPU, jax 0.10.2, the classes were M = 1, M = 2..32 and
M >= 48 for the shapes of a small Llama), so a token's logits would depend on how many
other tokens share its step. `tiled_matmul` runs the rows as a loop over `[tile, d]`
blocks (zero-padded): every row meets the same kernel with the same shape, whatever M and
wherever the row sits, so its bits are a function of the row alone. `row_classes` measures
which row counts change a row's bits, for any matmul function, on the current backend.

Legend: M rows, d input width, f output width, T tile rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


@partial(jax.jit, static_argnames=("tile",))
def tiled_matmul(x: jax.Array, w: jax.Array, tile: int) -> jax.Array:
    """x [..., d] @ w [d, ...] computed as a loop over [tile, d] row blocks.

    Leading axes of x are flattened into rows and trailing axes of w into columns (so a
    DenseGeneral kernel [D, N, H] works as is); the result has x's leading and w's trailing
    axes.
    """
    lead, d = x.shape[:-1], x.shape[-1]
    trail = w.shape[1:]
    rows = x.reshape(-1, d)  # [M, d]
    m = rows.shape[0]
    n = -(-m // tile)
    blocks = jnp.pad(rows, ((0, n * tile - m), (0, 0))).reshape(n, tile, d)  # [n, T, d]
    w2 = w.reshape(d, math.prod(trail))  # [d, f]
    out = jax.lax.map(lambda block: block @ w2, blocks)  # [n, T, f]
    return out.reshape(n * tile, -1)[:m].reshape(*lead, *trail)


def plain_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, d] @ w [d, f], as XLA chooses to compute it (the reference)."""
    return x @ w


def row_classes(matmul: Callable[[jax.Array, jax.Array], jax.Array], d: int, f: int,
                sizes: Sequence[int] = (1, 2, 3, 8, 16, 32, 33, 48, 64, 128, 256),
                seed: int = 0) -> list[int]:
    """The row counts M at which a row's bits differ from the same row computed alone
    (M = 1), checked for the first and the last row of each M: empty when the matmul is
    row-invariant on this backend at this shape."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((d, f)).astype(np.float32))
    x = rng.standard_normal((max(sizes), d)).astype(np.float32)
    fn = jax.jit(matmul)
    alone = {i: np.asarray(fn(jnp.asarray(x[i:i + 1]), w))[0] for i in {0, *[m - 1 for m in sizes]}}
    differ = []
    for m in sizes:
        out = np.asarray(fn(jnp.asarray(x[:m]), w))
        if not (np.array_equal(out[0], alone[0]) and np.array_equal(out[m - 1], alone[m - 1])):
            differ.append(m)
    return differ


def model_shapes(config) -> dict[str, tuple[int, int]]:
    """The (d, f) of every token-row matmul of a `ModelConfig`'s layers and head."""
    c = config
    return {"q": (c.d_model, c.num_heads * c.head_dim),
            "k/v": (c.d_model, c.num_kv_heads * c.head_dim),
            "o": (c.num_heads * c.head_dim, c.d_model),
            "mlp up": (c.d_model, c.d_ff), "mlp down": (c.d_ff, c.d_model),
            "head": (c.d_model, c.vocab_size)}
