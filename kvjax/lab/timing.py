"""Timing helpers the benchmarks and experiments share: medians of timed calls, the decode-step
timers, and the bandwidth a decode-shaped workload reaches on this machine.

Every time is a median of repetitions after warm-up; callers block on the result
(`block_until_ready`, or a host copy) inside the timed call.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.cache.paged import CacheHolder, quantize
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode import steps
from kvjax.decode.batching import bucket, page_table, pages_for
from kvjax.decode.state import decode_state


def median_timed(fn, reps: int, warmup: int = 0) -> tuple[float, object]:
    """(median seconds of `reps` timed calls of `fn` after `warmup` untimed ones, what the
    last timed call returned)."""
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def median_seconds(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of `reps` timed calls of `fn` after `warmup` untimed ones; what `fn`
    returns is dropped at once (no call's output is alive while the next one runs)."""

    def call() -> None:
        fn()

    return median_timed(call, reps, warmup)[0]


def measure_bandwidth(megabytes: int = 256, reps: int = 10) -> float:
    """Bytes/s a jitted float32 matrix-vector product streams (the decode-shaped workload)."""
    n = int((megabytes * 2**20 / 4) ** 0.5)
    w = noise(jnp.uint32(0), (n, n), jnp.float32)
    x = jnp.ones((n,), jnp.float32)
    matvec = jax.jit(lambda w, x: w @ x)
    seconds = median_seconds(lambda: matvec(w, x).block_until_ready(), reps)
    return n * n * 4 / seconds


def filled_with_noise(cache, seed: int = 0):
    """Pseudo-random K/V so attention reads real numbers (timing does not depend on them);
    quantized pages: the noise quantized, each (token, KV head) with its own scale."""
    k = noise(jnp.uint32(seed % 2**32), cache.k.shape, jnp.float32)
    if cache.k_scale is None:
        return cache.replace(k=cache.store(k), v=cache.store(k * 0.5))
    (kq, ks), (vq, vs) = quantize(k, cache.dtype), quantize(k * 0.5, cache.dtype)
    return cache.replace(k=cache.store(kq), v=cache.store(vq), k_scale=ks, v_scale=vs)


@partial(jax.jit, static_argnames=("shape", "dtype"))
def noise(seed: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """Values uniform in [-1, 1) (float32; bfloat16 rounds some to 1) from an integer hash
    of each element's index. Not `jax.random`: its threefry compiles for seconds per shape
    on XLA CPU with the fusion emitters off (`kvjax.backend`); this hash in a fraction."""
    x = lax.iota(jnp.uint32, math.prod(shape)) * jnp.uint32(0x9E3779B1) + seed
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    u = (x >> 8).astype(jnp.float32) * (2.0 / (1 << 24)) - 1.0  # 24 random bits each
    return u.reshape(shape).astype(dtype)


Holder = CacheHolder  # keeps the donated cache threaded through repeated timed calls


def contiguous_pages(cache_cfg: CacheConfig, batch: int, total: int):
    """A page table giving each of `batch` rows its own `total` tokens of pages, and the
    cache config with exactly that many pages."""
    per_row = pages_for(total, cache_cfg.page_size)
    rows = [list(range(i * per_row, (i + 1) * per_row)) for i in range(batch)]
    table = page_table(rows, batch, cache_cfg.block_pages)
    return table, dataclasses.replace(cache_cfg, num_pages=batch * per_row)


def multistep_seconds(params, config: ModelConfig, holder: Holder, table, lengths,
                      decode_steps: int, reps: int, kernel=None) -> float:
    """Seconds per token of `decode_steps` greedy tokens per row decoded on device by
    `steps.decode_loop` from `lengths` (the cache in `holder` is threaded through), with
    the decode-attention `kernel` (`kvjax.model.kernels.AttentionKernel`; None: reference)."""
    batch = len(lengths)
    state = decode_state(table, lengths, np.ones(batch), np.full(batch, decode_steps),
                         np.zeros((batch, 2)))

    def multi_step():
        np.asarray(steps.decode(holder, params, config, state, bucket(decode_steps, 16),
                                kernel=kernel).tokens)

    return median_seconds(multi_step, reps) / decode_steps
