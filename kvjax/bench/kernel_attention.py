"""`kvjax bench kernel`'s attention rows and arithmetic floor: kvjax's CPU attention
(`kvjax.cpu.attention`) beside XLA's paged attention under invariant and fast numerics,
and the CPU's peak rate of 16-lane fused multiply-adds, which bounds what any product of a
few rows can reach (gate c).

Attention: SmolLM2's heads (9 query heads over 3 KV heads of 64), its 30 layers one after
another in one jitted call (each layer's queries the last one's output), float32 pages of
16 tokens, random keys and values; a decode step of 1 and of 8 sequences at 512 keys, and
a prefill chunk of 256 queries after 256 cached tokens.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

from kvjax.cache.paged import BatchInfo, PagedKVCache
from kvjax.cpu import attention
from kvjax.cpu.product import kernel
from kvjax.lab.report import emit
from kvjax.model.attention import paged_attention_reference

HEADS = {"layers": 30, "heads": 9, "kv": 3, "head_dim": 64, "page": 16}
# (name, sequences, queries each, tokens cached before them)
CASES = (("decode, 1 sequence at 512 keys", 1, 1, 511),
         ("decode, 8 sequences at 512 keys", 8, 1, 511),
         ("prefill chunk of 256 after 256", 1, 256, 256))
FMA_ROUNDS = 20_000_000


def fma_rate(threads: int | None = None) -> float:
    """16-lane fused multiply-adds a second on `threads` threads at once (default: every
    core, as XLA's pool runs the products)."""
    lib = ctypes.CDLL(kernel().library)
    lib.kvjax_fma_rate.restype = ctypes.c_double
    lib.kvjax_fma_rate.argtypes = [ctypes.c_int64]
    threads = threads or os.cpu_count() or 1
    lib.kvjax_fma_rate(FMA_ROUNDS // 10)  # the clock up
    with ThreadPoolExecutor(threads) as pool:  # ctypes lets go of the GIL
        return sum(pool.map(lambda _: lib.kvjax_fma_rate(FMA_ROUNDS), range(threads)))


def _layers(fn):
    """jit of fn over every layer in turn: q [B, T, N, H] -> the last layer's output."""
    def run(q, cache, batch):
        for layer in range(HEADS["layers"]):
            q = q + fn(q, cache, layer, batch)
        return q
    return jax.jit(run)


def attention_rows(reps: int, rng, side_by_side) -> list[dict]:
    """One row per case: kvjax's attention and XLA's (invariant: tiles of 32 rows; fast)."""
    h = HEADS
    fns = [_layers(lambda q, c, i, b: attention.paged_attention(q, c, i, b, None)),
           _layers(lambda q, c, i, b: paged_attention_reference(q, c, i, b, None, 32)),
           _layers(lambda q, c, i, b: paged_attention_reference(q, c, i, b, None))]
    rows = []
    for name, seqs, queries, cached in CASES:
        block = max(1, 256 // h["page"])  # attention blocks of 256 keys (XLA's loop)
        per = -(-(cached + queries) // (h["page"] * block)) * block  # pages a sequence
        shape = (h["layers"], h["kv"], seqs * per, h["page"], h["head_dim"])
        cache = PagedKVCache(k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                             v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                             block_pages=block)
        batch = BatchInfo(jnp.arange(seqs * per, dtype=jnp.int32).reshape(seqs, per),
                          jnp.full(seqs, cached, jnp.int32), jnp.full(seqs, queries, jnp.int32))
        q = jnp.asarray(rng.standard_normal((seqs, queries, h["heads"], h["head_dim"])),
                        jnp.float32)
        args = (q, cache, batch)
        ours, xla, fast = side_by_side(
            [lambda f=f, a=args: f(*a).block_until_ready() for f in fns], reps)
        rows.append({"shape": f"attention, {name}", "rows": seqs * queries,
                     "xla_ms": xla * 1e3, "kernel_ms": ours * 1e3, "xla_fast_ms": fast * 1e3,
                     "bits": None})
        emit(f"attention, {name}: XLA {xla * 1e3:.1f} ms (fast numerics {fast * 1e3:.1f}), "
             f"kernel {ours * 1e3:.1f} ms")
    return rows


def chain_macs(dims: dict) -> int:
    """Multiply-adds of one row through the chain of `kvjax.bench.kernel.SMOLLM2`'s
    products: every layer's q, o (d x d), k, v (d x kv), gate, up, down (d x ff), and the
    head (d x vocab)."""
    d, ff, kv = dims["d"], dims["ff"], dims["kv"]
    return dims["layers"] * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * dims["vocab"]


def floor_ms(dims: dict, rows: int, rate: float) -> float:
    """The least time `rows` rows of the chain can take at `rate` 16-lane FMAs a second."""
    return rows * chain_macs(dims) / 16 / rate * 1e3
