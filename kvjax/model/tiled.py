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

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend

BLOCKS = (2, 4, 8, 16, 32, 64, 128, 256)  # the block sizes `invariant_block` considers


def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis by halving it with elementwise adds (zero-padded to a power of
    two): the order of the adds is fixed by the axis length alone. A plain `sum` is not:
    XLA CPU vectorises a row reduction by the whole array's shape, so a row's sum changes
    in the last bits with the number of other rows (measured on [n, 16, 2, 4, 16] rows)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def row_softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis with a fixed-order sum (`tree_sum`): each row's bits do not
    depend on how many rows there are (`jax.nn.softmax` does, on XLA CPU)."""
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True)))
    return e / tree_sum(e)[..., None]


def row_blocks(fn: Callable[[jax.Array], jax.Array], rows: jax.Array, block: int) -> jax.Array:
    """fn over `rows` [M, ...] with every call between 2 and `block` rows: a single row is
    padded to two, up to `block` rows are one call, more a loop (`lax.map`) over
    `block`-row calls, the last zero-padded. fn must act on each row alone (a product of
    rows with weights, say); then a row's bits are those of a call of its own size class."""
    m = rows.shape[0]
    pad = [(0, 0)] * (rows.ndim - 1)
    if m <= block:
        return fn(jnp.pad(rows, [(0, max(2 - m, 0)), *pad]))[:m]
    n = -(-m // block)
    blocks = jnp.pad(rows, [(0, n * block - m), *pad]).reshape(n, block, *rows.shape[1:])
    out = jax.lax.map(fn, blocks)  # [n, B, ...]
    return out.reshape(n * block, *out.shape[2:])[:m]


@partial(jax.jit, static_argnames=("block",))
def invariant_matmul(x: jax.Array, w: jax.Array, block: int) -> jax.Array:
    """x [..., d] @ w [d, ...] with every dot between 2 and `block` rows (see the module
    docstring); leading axes of x are flattened into rows and trailing axes of w into
    columns (a DenseGeneral kernel [D, N, H] works as is)."""
    lead, d, trail = x.shape[:-1], x.shape[-1], w.shape[1:]
    w2 = w.reshape(d, math.prod(trail))  # [d, f]
    out = row_blocks(lambda r: r @ w2, x.reshape(-1, d), block)  # [M, f]
    return out.reshape(*lead, *trail)


@dataclasses.dataclass(frozen=True)
class RowInvariantDot:
    """A `lax.dot_general` for Flax's Dense, DenseGeneral and Embed.attend whose rows are
    computed in `row_blocks` of at most `block` rows. The contracted axes of the input must
    be its trailing ones and there may be no batch axes: every other input axis is a row
    axis. The weights are used as stored (no transpose), so the kernel XLA picks is the
    one the plain product of a block would get."""

    block: int

    def __call__(self, x: jax.Array, w: jax.Array, dimension_numbers, precision=None,
                 preferred_element_type=None) -> jax.Array:
        (x_contract, w_contract), (x_batch, w_batch) = dimension_numbers
        x_contract = tuple(a % x.ndim for a in x_contract)
        n = len(x_contract)
        if x_batch or w_batch or x_contract != tuple(range(x.ndim - n, x.ndim)):
            raise ValueError(f"RowInvariantDot: contract the trailing input axes without "
                             f"batch axes, got {dimension_numbers}")
        lead = x.shape[: x.ndim - n]
        dims = ((tuple(range(1, n + 1)), tuple(w_contract)), ((), ()))
        rows = x.reshape(-1, *x.shape[x.ndim - n:])  # [M, *contracted]
        out = row_blocks(lambda r: jax.lax.dot_general(
            r, w, dims, precision=precision, preferred_element_type=preferred_element_type),
            rows, self.block)
        return out.reshape(*lead, *out.shape[1:])


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
    out = {}
    for name, (shape, contract) in _dot_shapes(config).items():
        d = math.prod(shape[a] for a in contract)
        out[name] = (d, math.prod(shape) // d)
    return out


def _dot_shapes(config) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(weight shape, contracted weight axes) of every token-row product of a ModelConfig,
    as the layers store them (the head as the tied embedding [V, D] when tied)."""
    c = config
    dense = {"q": ((c.d_model, c.num_heads, c.head_dim), (0,)),
             "k/v": ((c.d_model, c.num_kv_heads, c.head_dim), (0,)),
             "o": ((c.num_heads, c.head_dim, c.d_model), (0, 1)),
             "mlp up": ((c.d_model, c.d_ff), (0,)), "mlp down": ((c.d_ff, c.d_model), (0,))}
    dense["head"] = (((c.vocab_size, c.d_model), (1,)) if c.tie_embeddings
                     else ((c.d_model, c.vocab_size), (0,)))
    return dense


@functools.lru_cache(maxsize=64)
def _probe_dot(w_shape: tuple[int, ...], contract: tuple[int, ...], block: int,
               backend: str) -> bool:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal(w_shape).astype(np.float32))
    x_shape = tuple(w_shape[a] for a in contract)
    n = 2 * block + 3
    x = jnp.asarray(rng.standard_normal((n, *x_shape)).astype(np.float32))
    dims = (tuple(range(1, 1 + len(contract))), contract)
    dot = jax.jit(lambda r: RowInvariantDot(block)(r, w, (dims, ((), ()))))
    alone = [np.asarray(dot(x[i:i + 1]))[0] for i in (0, 2, n - 1)]
    for m, rows in ((3, (0, 2)), (n, (0, 2, n - 1))):
        out = np.asarray(dot(x[:m]))
        for i in rows:
            if not np.array_equal(out[i], alone[(0, 2, n - 1).index(i)]):
                return False
    return True


def check_products(config) -> list[str]:
    """The token-row products of `config` whose rows do not get the same bits alone as in
    a block of three and in a loop of blocks of `config.row_block` rows, on the running
    backend (cached per shape): empty when the products are invariant."""
    return [name for name, (shape, contract) in _dot_shapes(config).items()
            if not _probe_dot(shape, contract, config.row_block, jax.default_backend())]


def check_backend() -> list[str]:
    """Names XLA CPU's fusion emitters when they are on (see `kvjax.backend`): they break
    invariance inside loops, where no product probe sees it."""
    if jax.default_backend() == "cpu" and not backend.fusion_emitters_off():
        return ["XLA CPU fusion emitters (set XLA_FLAGS="
                f"{backend.FUSION_FLAG}=false before JAX starts)"]
    return []


def check_rows(config) -> list[str]:
    """`check_products` and `check_backend`: empty when invariant numerics hold."""
    return check_products(config) + check_backend()
