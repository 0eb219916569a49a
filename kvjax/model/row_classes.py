"""Measuring a backend's row classes: which row counts of a plain product change a row's
bits (`row_classes`), and the largest block whose counts all agree (`invariant_block`).
Tools for finding what `kvjax.model.tiled` relies on; the engine's own probes are there.

Legend: M rows, d input width, f output width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

BLOCKS = (2, 4, 8, 16, 32, 64, 128, 256)  # the block sizes `invariant_block` considers


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
