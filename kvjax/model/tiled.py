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
dots (a dot inside the loop has the bits of the same dot alone). The classes differ by CPU
(on AVX2 the attention's value product changes a row's bits at 8 rows of 2..32), so the
engine probes the running backend (`choose_blocks`); `kvjax.model.row_classes` measures
them.

Legend: M rows, d input width, f output width, B block rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend
from kvjax.model import layout, probe_cache
from kvjax.model.plan import STORED_PRODUCTS


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
    `block`-row calls, the last zero-padded. Block 0: one call of any M >= 2 (for a
    product whose rows the backend keeps invariant at every row count, see
    `choose_blocks`). fn must act on each row alone (a product of rows with weights, say);
    then a row's bits are those of a call of its own size class."""
    m = rows.shape[0]
    pad = [(0, 0)] * (rows.ndim - 1)
    if block == 0 or m <= block:
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


def model_shapes(config, fused: bool = False) -> dict[str, tuple[int, int]]:
    """The (d, f) of every token-row matmul of a `ModelConfig`'s layers and head (q/k/v and
    gate/up as one product each when `fused`)."""
    out = {}
    for name, (shape, contract) in _dot_shapes(config, fused).items():
        d = math.prod(shape[a] for a in contract)
        out[name] = (d, math.prod(shape) // d)
    return out


def _dot_shapes(config, fused: bool) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(weight shape, contracted weight axes) of every token-row product of a ModelConfig,
    as the layers store them (the head as the tied embedding [V, D] when tied)."""
    c = config
    if fused:  # q, k and v as one product, a gated MLP's gate and up as one
        dense = {"qkv": ((c.d_model, c.num_heads + 2 * c.num_kv_heads, c.head_dim), (0,))}
    else:
        dense = {"q": ((c.d_model, c.num_heads, c.head_dim), (0,)),
                 "k/v": ((c.d_model, c.num_kv_heads, c.head_dim), (0,))}
    up = 2 * c.d_ff if fused and c.mlp != "gelu" else c.d_ff
    dense |= {"o": ((c.num_heads, c.head_dim, c.d_model), (0, 1)),
              "mlp up": ((c.d_model, up), (0,)), "mlp down": ((c.d_ff, c.d_model), (0,))}
    dense["head"] = (((c.vocab_size, c.d_model), (1,)) if c.tie_embeddings
                     else ((c.d_model, c.vocab_size), (0,)))
    return dense


@functools.lru_cache(maxsize=64)
@probe_cache.persistent  # and on disk, across processes
def _probe_dot(w_shape: tuple[int, ...], contract: tuple[int, ...], block: int,
               backend: str) -> bool:
    """A product in blocks of `block` rows: rows alone == in a block of three == in a loop
    of blocks."""
    n = 2 * block + 3
    return _rows_agree(w_shape, contract, block, (3, n))


@functools.lru_cache(maxsize=64)
@probe_cache.persistent  # and on disk, across processes
def _probe_whole(w_shape: tuple[int, ...], contract: tuple[int, ...], max_rows: int,
                 backend: str, stored: bool = False) -> bool:
    """A product as one dot of any row count: rows alone == at every probed count up to
    `max_rows`; `stored`: with the kernel stored transposed (`kvjax.model.layout`)."""
    return _rows_agree(w_shape, contract, 0, probe_counts(max_rows), stored)


def probe_counts(max_rows: int) -> list[int]:
    """The row counts a whole-product probe tries: 3, 5, 9, 17, 33, ... (2^k + 1, just past
    each power of two, where kernels change their tiling) and `max_rows`, compared with 2
    rows: a class boundary goes unseen only if it flips back before the next count."""
    counts, k = [], 1
    while (1 << k) + 1 < max_rows:
        counts.append((1 << k) + 1)
        k += 1
    return counts + [max(max_rows, 2)]


def _rows_agree(w_shape: tuple[int, ...], contract: tuple[int, ...], block: int,
                counts: Sequence[int], stored: bool = False) -> bool:
    """Rows 0, 2 and the last of `RowInvariantDot(block)` products of each count in
    `counts` have the bits of the same rows computed alone. `stored`: the kernel (whose
    contracted axes lead) arrives stored transposed and the product takes the canonical
    view, as a step does (`kvjax.model.layout`)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(w_shape).astype(np.float32)
    x_shape = tuple(w_shape[a] for a in contract)
    x = jnp.asarray(rng.standard_normal((max(counts), *x_shape)).astype(np.float32))
    dims = (tuple(range(1, 1 + len(contract))), contract)
    inputs = len(contract)
    if stored:
        w = layout.to_stored(w, inputs)
    w = jnp.asarray(w)

    @jax.jit
    def dot(r, w):
        w = layout.from_stored(w, inputs) if stored else w
        return RowInvariantDot(block)(r, w, (dims, ((), ())))

    return rows_keep_bits(lambda lo, hi: np.asarray(dot(x[lo:hi], w)), counts)


def rows_keep_bits(call: Callable[[int, int], np.ndarray], counts: Sequence[int]) -> bool:
    """Whether rows 0, 2 and the last of `call(0, m)` (a computation of rows 0..m) have the
    bits of `call(i, i + 1)` (the row alone), for every m in `counts`."""
    alone = {}
    for m in counts:
        out = call(0, m)
        for i in {0, min(2, m - 1), m - 1}:
            if i not in alone:
                alone[i] = call(i, i + 1)[0]
            if not np.array_equal(out[i], alone[i]):
                return False
    return True


def attention_products(q, p, k):
    """The two products `_probe_attention` checks: [B, K, 1, R, S] scores and [B, K, 1, R, H]
    mixed values."""
    return (jnp.einsum("BKnRH,BKnSH->BKnRS", q, k), jnp.einsum("BKnRS,BKnSH->BKnRH", p, k))


@functools.lru_cache(maxsize=32)
@probe_cache.persistent  # and on disk, across processes
def _probe_attention(kv_heads: int, head_dim: int, keys: int, max_rows: int,
                     backend: str) -> bool:
    """Paged attention's two products (`kvjax.model.attention`: a KV head's query rows
    against a block of `keys` keys, then their probabilities against the values) as one
    product of any row count: each of three sequences' rows has the bits it has in that
    sequence alone, at every probed count of rows."""
    rng = np.random.default_rng(0)
    n = max(max_rows, 2)
    q = jnp.asarray(rng.standard_normal((3, kv_heads, 1, n, head_dim)).astype(np.float32))
    p = jnp.asarray(rng.random((3, kv_heads, 1, n, keys)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((3, kv_heads, 1, keys, head_dim)).astype(np.float32))

    both = jax.jit(attention_products)

    def rows(m: int, lo: int = 0, seqs: slice = slice(0, 3)) -> list[np.ndarray]:
        return [np.asarray(a) for a in both(q[seqs, :, :, lo:m], p[seqs, :, :, lo:m],
                                            k[seqs])]

    alone = [slice(b, b + 1) for b in range(3)]
    pairs = [rows(2, seqs=b) for b in alone]
    for m in probe_counts(max_rows):
        together = rows(m)
        for b, pair in zip(alone, pairs, strict=True):
            last = rows(m, m - 2, seqs=b)
            for out, two, end in zip(together, pair, last, strict=True):
                if not (np.array_equal(out[b, :, :, :2], two)
                        and np.array_equal(out[b, :, :, m - 1], end[:, :, :, 1])):
                    return False
    return True


@functools.lru_cache(maxsize=32)
@probe_cache.persistent  # and on disk, across processes
def _probe_attention_tile(kv_heads: int, head_dim: int, keys: int, tile: int,
                          backend: str) -> bool:
    """Paged attention's two products in tiles of up to `tile` rows (the attention's
    `row_tile`: a call's query rows in tiles of 2..tile rows): at every row count 2..tile
    (every one: on AVX2 the value product's classes are not runs of counts, 8 rows differ
    from 2 where 10 do not), each row has the bits it has in a tile of two, in each of
    three sequences sharing the call."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, kv_heads, 1, tile, head_dim)).astype(np.float32)
    p = rng.random((3, kv_heads, 1, tile, keys)).astype(np.float32)
    k = jnp.asarray(rng.standard_normal((3, kv_heads, 1, keys, head_dim)).astype(np.float32))
    both = jax.jit(attention_products)
    first = [min(i, tile - 2) for i in range(tile)]  # row i's pair: rows first[i], + 1
    pairs = np.stack([np.arange(j, j + 2) for j in first[:-1]])  # [tile - 1, 2]
    ref = [np.asarray(a) for a in both(  # tile j of the pairs: rows j, j + 1
        jnp.asarray(q[:, :, 0][:, :, pairs]), jnp.asarray(p[:, :, 0][:, :, pairs]),
        jnp.broadcast_to(k, (3, kv_heads, tile - 1, keys, head_dim)))]
    for m in range(2, tile + 1):
        out = [np.asarray(a) for a in both(jnp.asarray(q[:, :, :, :m]),
                                           jnp.asarray(p[:, :, :, :m]), k)]
        for got, want in zip(out, ref, strict=True):
            for i in range(m):
                if not np.array_equal(got[:, :, 0, i], want[:, :, first[i], i - first[i]]):
                    return False
    return True


def _attention_tile(config, calls: Calls, tile: int, backend_name: str) -> bool:
    """`_probe_attention_tile` for `config`'s heads against `calls.keys` keys."""
    return _probe_attention_tile(config.num_kv_heads, config.head_dim, calls.keys, tile,
                                 backend_name)


class Calls(NamedTuple):
    """The largest calls a whole-product probe must cover: `rows` tokens in a call (every
    layer product), `head_rows` rows of logits, `queries` tokens of one sequence against
    attention blocks of `keys` keys."""

    rows: int
    head_rows: int
    queries: int
    keys: int

    def of(self, product: str) -> int:
        return self.head_rows if product == "head" else self.rows


# the least the engine's probe covers (keys: unused), whatever its knobs ask for
PROBED = Calls(rows=2048, head_rows=256, queries=512, keys=0)


def check_products(config, plan, calls: Calls | None = None) -> list[str]:
    """The token-row products of `config` whose rows do not keep their bits on the running
    backend under `plan` (cached per shape): each at its `plan.block(name)` (a block: alone,
    in a block of three and in a loop of blocks; 0: at every probed row count up to
    `calls`' bound; attention, with `calls`: a KV head's query rows of `calls.queries`
    tokens, or its tiles, against `calls.keys` keys). Empty when all hold."""
    backend_name = jax.default_backend()
    failed = []
    for name, (shape, contract) in _dot_shapes(config, plan.fused).items():
        block = plan.block(name)
        ok = (_whole(shape, contract, calls.of(name), backend_name, name in plan.transposed)
              if block == 0 else _probe_dot(shape, contract, block, backend_name))
        if not ok:
            failed.append(name)
    tile = plan.block("attention")
    if calls is not None and not plan.cpu_attention and not (
            _attention_whole(config, calls, backend_name) if tile == 0
            else _attention_tile(config, calls, tile, backend_name)):
        failed.append("attention")
    return failed


def rows_bound(rows: int) -> int:
    """The row count a whole-product probe goes up to for calls of `rows`: the next power of
    two, at least 64 (one probe serves every engine whose calls fit under it)."""
    return max(64, 1 << max(rows - 1, 0).bit_length())


def _whole(shape: tuple[int, ...], contract: tuple[int, ...], rows: int, backend_name: str,
           stored: bool = False) -> bool:
    """`_probe_whole` for calls of up to `rows` rows."""
    return _probe_whole(shape, contract, rows_bound(rows), backend_name, stored)


def _attention_whole(config, calls: Calls, backend_name: str) -> bool:
    """`_probe_attention` for `config`'s heads in `calls`."""
    return _probe_attention(config.num_kv_heads, config.head_dim, calls.keys,
                            rows_bound(calls.queries * config.group_size), backend_name)


def choose_blocks(config, plan, calls: Calls, transpose: bool = True,
                  candidates: Sequence[int] = (32, 16, 8, 4, 2), extra: dict | None = None):
    """Per token-row product of `config` under `plan` (its `fused` decides the products;
    attention included; `extra`: more products its steps run, {name: (weight shape,
    contracted weight axes)}, as `kvjax.speculative.eagle.head_products`), the cheapest
    row block the running backend keeps invariant in `calls`: 0 (one product of any row
    count) when that holds; else, with `transpose`, 0 with the kernel stored transposed
    when that holds (`kvjax.model.layout`; a layer's or the untied head's); else the
    largest of `plan.row_block` and `candidates` that does (attention falls back to tiles
    of `row_block`, which the invariance tests check). Under `plan.cpu_kernel` kvjax's
    kernel runs every product (invariant by construction): attention alone is probed, and
    under `plan.cpu_attention` (kvjax's attention, invariant too) nothing. Returns
    (`NumericsPlan.row_blocks`, `NumericsPlan.transposed`, the products no block holds
    for)."""
    backend_name = jax.default_backend()
    blocks, transposed, failed = [], [], []
    products = {} if plan.cpu_kernel else _dot_shapes(config, plan.fused) | (extra or {})
    for name, (shape, contract) in products.items():
        rows = calls.of(name)
        if _whole(shape, contract, rows, backend_name):
            blocks.append((name, 0))
            continue
        if transpose and contract[0] == 0 and name in STORED_PRODUCTS and _whole(
                shape, contract, rows, backend_name, True):
            blocks.append((name, 0))
            transposed.append(name)
            continue
        tried = [plan.row_block] + [b for b in candidates if b < plan.row_block]
        good = [b for b in tried if _probe_dot(shape, contract, b, backend_name)][:1]
        blocks.append((name, good[0] if good else plan.row_block))
        failed += [] if good else [name]
    if not plan.cpu_attention:
        tried = [plan.row_block] + [b for b in candidates if b < plan.row_block]
        good = ([0] if _attention_whole(config, calls, backend_name) else
                [b for b in tried if _attention_tile(config, calls, b, backend_name)][:1])
        blocks.append(("attention", good[0] if good else plan.row_block))
        failed += [] if good else ["attention"]
    return tuple(blocks), tuple(transposed), failed


def check_backend() -> list[str]:
    """Names the XLA CPU settings that break invariance where no product probe looks (see
    `kvjax.backend`): fusion emitters on (inside loops), optimization level 0."""
    if jax.default_backend() != "cpu":
        return []
    problems = []
    if not backend.fusion_emitters_off():
        problems.append("XLA CPU fusion emitters (set XLA_FLAGS="
                        f"{backend.FUSION_FLAG}=false before JAX starts)")
    if backend.optimization_off(disable_most=jax.config.read("jax_disable_most_optimizations")):
        problems.append(f"XLA backend optimization level 0 ({backend.LEVEL_FLAG}=0 or "
                        "jax_disable_most_optimizations)")
    return problems


def check_rows(config, plan, calls: Calls | None = None) -> list[str]:
    """`check_products` and `check_backend`: empty when `plan`'s invariant numerics hold."""
    return check_products(config, plan, calls) + check_backend()
