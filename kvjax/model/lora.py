"""LoRA adapters: rank-r deltas on the attention (q, k, v, o) and MLP projections.

An adapter is a pytree `{"layer_i": {"attn": {"q": {"a": [in, r], "b": [r, out]}, ...},
"mlp": {...}}}`; the delta of a projection is `(x @ a) @ b`. Several adapters are stacked
side by side (index 0 is "no adapter": zeros, which add exactly nothing) and each
sequence of a batch picks its own with `adapter_ids`.

Legend: A adapters, B batch, T tokens, I projection input width, R rank, O output width.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.model import probe_cache
from kvjax.model.tiled import probe_counts, row_blocks, rows_bound, rows_keep_bits


def lora_targets(config: ModelConfig) -> dict[str, dict[str, tuple[int, int]]]:
    """(input width, output width) of every projection an adapter may change."""
    d, h = config.d_model, config.head_dim
    attn = {"q": (d, config.num_heads * h), "k": (d, config.num_kv_heads * h),
            "v": (d, config.num_kv_heads * h), "o": (config.num_heads * h, d)}
    names = ("gate", "up") if config.mlp in ("swiglu", "geglu") else ("up",)
    mlp = dict.fromkeys(names, (d, config.d_ff))
    mlp["down"] = (config.d_ff, d)
    return {"attn": attn, "mlp": mlp}


def init_adapter(config: ModelConfig, rank: int, seed: int = 0,
                 scale: float = 0.02) -> dict:
    """A random rank-`rank` adapter (both factors random, so it changes the outputs)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    rng = np.random.default_rng(seed)
    adapter = {}
    for layer in range(config.num_layers):
        adapter[f"layer_{layer}"] = {
            part: {name: {"a": rng.normal(0, i**-0.5, (i, rank)).astype(np.float32),
                          "b": rng.normal(0, scale, (rank, o)).astype(np.float32)}
                   for name, (i, o) in targets.items()}
            for part, targets in lora_targets(config).items()}
    return jax.tree_util.tree_map(jnp.asarray, adapter)


def stack_adapters(config: ModelConfig, adapters: list[dict]) -> dict:
    """Stacks adapters into the model's "lora" collection: projection `name`'s `{name}_a` is
    [I, A, R] and `{name}_b` [A, R, O] for A = len(adapters) + 1 adapters; index 0 is the
    zero adapter. Ranks may differ: smaller ones are zero-padded (which adds exactly
    nothing). Both reshape for free to the side-by-side factors of `stacked_delta`.
    """
    rank = max([1] + [a["layer_0"]["attn"]["q"]["a"].shape[1] for a in adapters])
    count = len(adapters) + 1
    stacked = {}
    for layer in range(config.num_layers):
        key = f"layer_{layer}"
        stacked[key] = {}
        for part, targets in lora_targets(config).items():
            stacked[key][part] = {}
            for name, (i, o) in targets.items():
                a = np.zeros((i, count, rank), np.float32)
                b = np.zeros((count, rank, o), np.float32)
                for n, adapter in enumerate(adapters, start=1):
                    factors = adapter[key][part][name]
                    r = factors["a"].shape[1]
                    a[:, n, :r] = factors["a"]
                    b[n, :r] = factors["b"]
                stacked[key][part][f"{name}_a"] = jnp.asarray(a)
                stacked[key][part][f"{name}_b"] = jnp.asarray(b)
    return stacked


def stacked_shapes(lora: dict) -> list[tuple[int, int, int, int]]:
    """The distinct (input width, adapters, rank, output width) of a stacked collection's
    projections: the shapes `stacked_delta` multiplies by."""
    return sorted({(*targets[f"{name}_a"].shape, targets[f"{name}_b"].shape[-1])
                   for layer in lora.values() for targets in layer.values()
                   for name in {key[:-2] for key in targets}})


def stacked_delta(x: jax.Array, a: jax.Array, b: jax.Array, adapter_ids: jax.Array,
                  block: int) -> jax.Array:
    """Every row's delta from its own adapter as two products of fixed weights, every
    adapter's factors side by side, each product in `row_blocks` of `block` rows
    (`kvjax.model.tiled`), so a row's bits do not depend on the other rows: x @ a gives
    every adapter's x @ a_n, the other adapters' columns are set to zero (a non-finite
    adapter cannot leak into other rows), and the product with b sums the row's own
    adapter's terms and exact zeros. A row's bits depend on its adapter's index, the
    number of adapters and the largest rank: they hold within one engine's adapter set.

    Args:
      x: [M, I] rows; a: [I, A, R]; b: [A, R, O]; adapter_ids: int32[M]. Returns [M, O].
    """
    i, count, rank = a.shape
    xa = row_blocks(lambda rows: rows @ a.reshape(i, count * rank), x, block)  # [M, A * R]
    keep = adapter_ids[:, None] == jnp.arange(count)  # [M, A]
    xa = jnp.where(keep[:, :, None], xa.reshape(-1, count, rank), 0).reshape(xa.shape)
    return row_blocks(lambda rows: rows @ b.reshape(count * rank, -1), xa, block)


def choose_block(shapes: Sequence[tuple[int, int, int, int]], rows: int, row_block: int,
                 candidates: Sequence[int] = (32, 16, 8, 4, 2)) -> int | None:
    """The cheapest row block (`stacked_delta`) the running backend keeps invariant for
    every shape in `shapes` (`stacked_shapes`) in calls of up to `rows` rows: 0 (one
    product of any row count) when that holds, else the largest of `row_block` and
    `candidates` that does; None when none does."""
    backend_name = jax.default_backend()
    tried = [0, row_block] + [b for b in candidates if b < row_block]
    for block in tried:
        bound = rows_bound(rows) if block == 0 else 2 * block + 3
        if all(_probe_lora(tuple(shape), block, bound, backend_name) for shape in shapes):
            return block
    return None


@functools.lru_cache(maxsize=64)
@probe_cache.persistent  # and on disk, across processes
def _probe_lora(shape: tuple[int, int, int, int], block: int, max_rows: int,
                backend: str) -> bool:
    """`stacked_delta` for (input width, adapters, rank, output width) `shape`, each row
    with its own adapter: rows 0, 2 and the last of calls of every probed count up to
    `max_rows` (a block: 3 rows and a loop of blocks) have the bits they get alone."""
    i, count, rank, o = shape
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((i, count, rank)).astype(np.float32))
    b = jnp.asarray(rng.standard_normal((count, rank, o)).astype(np.float32))
    counts = probe_counts(max_rows) if block == 0 else (3, max_rows)
    x = jnp.asarray(rng.standard_normal((max(counts), i)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, count, max(counts)).astype(np.int32))
    delta = jax.jit(lambda x, ids, a, b: stacked_delta(x, a, b, ids, block))
    return rows_keep_bits(lambda lo, hi: np.asarray(delta(x[lo:hi], ids[lo:hi], a, b)), counts)


def add_lora(module: nn.Module, name: str, x: jax.Array, y: jax.Array,
             adapter_ids: jax.Array | None, in_dims: int = 1,
             block: int | None = None) -> jax.Array:
    """y + the selected adapter's delta for projection `name` (y unchanged without LoRA).

    `block` (invariant numerics: the config's "lora" row block) computes the deltas with
    `stacked_delta`, whose rows keep their bits whatever the other rows; None: one batched
    einsum per factor on the gathered adapters, whose row bits change with the number of
    tokens.

    Args:
      x: [B, T, *in] the projection input (`in_dims` trailing input axes); y: [B, T, *out].
      adapter_ids: int32[B] adapters' indices in the stacked collection, or None.
    """
    if adapter_ids is None or not module.has_variable("lora", f"{name}_a"):
        return y
    a = module.get_variable("lora", f"{name}_a").astype(x.dtype)  # [I, A, R]
    b = module.get_variable("lora", f"{name}_b").astype(x.dtype)  # [A, R, O]
    flat = x.reshape(*x.shape[:2], -1) if in_dims > 1 else x  # [B, T, I]
    if block is not None:
        ids = jnp.broadcast_to(adapter_ids[:, None], flat.shape[:2]).reshape(-1)  # [B * T]
        delta = stacked_delta(flat.reshape(-1, flat.shape[-1]), a, b, ids, block)
    else:
        delta = jnp.einsum("BTR,BRO->BTO", jnp.einsum("BTI,IBR->BTR", flat, a[:, adapter_ids]),
                           b[adapter_ids])
    return y + delta.reshape(y.shape)
