"""The three phases `scripts/device_check` runs (see `kvjax.bench.device_check`): the
decode-attention kernel against the reference, prefix-reuse TTFT in the engine, and decode
throughput with its achieved HBM bandwidth; and the random weights they run on.

Every time is a median of timed repetitions after warm-up (`kvjax.lab.timing`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache.paged import BatchInfo, PagedKVCache, init_cache
from kvjax.config import CacheConfig, EngineConfig, ModelConfig
from kvjax.decode.batching import page_table, pages_for
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.lab.progress import Progress
from kvjax.lab.timing import (
    Holder,
    contiguous_pages,
    filled_with_noise,
    median_seconds,
    multistep_seconds,
)
from kvjax.model.attention import paged_attention_reference
from kvjax.model.kernels import (
    TOLERANCE,
    AttentionKernel,
    kernel_limits,
    paged_decode_attention,
)
from kvjax.model.transformer import param_shapes

# XLA's RngBitGenerator: random values for timing compile in a fraction of threefry's time.
RNG = "unsafe_rbg"


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random weights of `config` made on the device in its own dtype: normal * 0.02, norm
    scales 1, biases 0. Nothing float32 of full size exists on host or device."""
    shapes = param_shapes(config)  # nothing allocated
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    dtype = jnp.dtype(config.dtype)

    @jax.jit
    def make():
        keys = jax.random.split(jax.random.key(seed, impl=RNG), len(leaves))
        out = []
        for (path, leaf), key in zip(leaves, keys, strict=True):
            name = getattr(path[-1], "key", "")
            if name == "scale":
                out.append(jnp.ones(leaf.shape, dtype))
            elif name == "bias":
                out.append(jnp.zeros(leaf.shape, dtype))
            else:
                out.append(jax.random.normal(key, leaf.shape, dtype) * jnp.asarray(0.02, dtype))
        return treedef.unflatten(out)

    return make()


# -- kernel ------------------------------------------------------------------------------------
def kernel_case(config: ModelConfig, cache_cfg: CacheConfig, rows: int, max_len: int,
                q_dtype, cache_dtype, seed: int = 0):
    """(q [B, 1, N, H], a 2-layer cache, batch) for one decode step over ragged lengths.

    Pages are shuffled in the pool and every slot holds random values, written or not. Rows
    include the longest length, a single key, and one that ends exactly on a page boundary.
    """
    rng = np.random.default_rng(seed)
    ps = cache_cfg.page_size
    lengths = rng.integers(1, max_len, rows)
    lengths[: 3] = [max_len - 1, 0, ps - 1][: rows]
    counts = [pages_for(n + 1, ps) for n in lengths]
    num_pages = sum(counts) + 1
    ids = iter(rng.permutation(num_pages).tolist())
    table = page_table([[next(ids) for _ in range(c)] for c in counts], rows,
                       cache_cfg.block_pages)
    shape = (2, config.num_kv_heads, num_pages, ps, config.head_dim)
    kk, kv, kq = jax.random.split(jax.random.key(seed, impl=RNG), 3)
    cache = PagedKVCache(k=jax.random.normal(kk, shape, cache_dtype),
                         v=jax.random.normal(kv, shape, cache_dtype),
                         block_pages=cache_cfg.block_pages)
    batch = BatchInfo(page_table=jnp.asarray(table), lengths=jnp.asarray(lengths, jnp.int32),
                      num_new=jnp.ones(rows, jnp.int32))
    q = jax.random.normal(kq, (rows, 1, config.num_heads, config.head_dim), q_dtype)
    return q, cache, batch


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def check_kernel(config: ModelConfig, cache_cfg: CacheConfig, backend: str, interpret: bool,
                 rows: int, max_len: int, reps: int) -> dict:
    """The kernel against the reference on layer 1, then both timed alone in bfloat16.

    Cases: bfloat16, and float32 at JAX's default matmul precision and at "highest". On a
    GPU the default lets float32 dots run in TF32, in the reference (XLA) and in the kernel
    (Triton) alike, so that case is reported but does not gate `passed`: the documented
    float32 tolerance holds for float32 arithmetic. `exact` is the reference in float32 at
    "highest": its distance to each side tells whose error it is.
    """
    if backend == "reference":
        return {"backend": backend, "passed": None,
                "skipped": "no kernel for this device or model (see resolve_backend)"}
    kernel = jax.jit(lambda q, c, b: paged_decode_attention(q, c, 1, b, backend, interpret))
    reference = jax.jit(lambda q, c, b: paged_attention_reference(q, c, 1, b, None))
    cases = []
    for q_name, precision, gates in (("bfloat16", None, True), ("float32", None, False),
                                     ("float32", "highest", True)):
        cache_name = q_name
        if kernel_limits(backend, head_dim=config.head_dim, cache_dtype=cache_name):
            cache_name = "bfloat16"  # pallas_tpu: float32 queries over a bfloat16 cache
        q, cache, batch = kernel_case(config, cache_cfg, rows, max_len, q_name, cache_name)
        with jax.default_matmul_precision(precision):
            out, ref = kernel(q, cache, batch), reference(q, cache, batch)
        with jax.default_matmul_precision("highest"):
            wide = cache.replace(k=cache.k.astype(jnp.float32), v=cache.v.astype(jnp.float32))
            exact = reference(q.astype(jnp.float32), wide, batch)
        out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        tol = TOLERANCE[q_name]
        passed = bool(np.isfinite(out32).all()
                      and np.allclose(out32, ref32, atol=tol, rtol=tol))
        cases.append({"q_dtype": q_name, "cache_dtype": cache_name,
                      "precision": precision or "default", "gates": gates, "tol": tol,
                      "max_abs_error": _max_abs(out32, ref32), "passed": passed,
                      "kernel_vs_exact": _max_abs(out32, exact),
                      "reference_vs_exact": _max_abs(ref32, exact)})
        del cache, wide
    q, cache, batch = kernel_case(config, cache_cfg, rows, max_len, "bfloat16", "bfloat16")
    ref_s = median_seconds(lambda: reference(q, cache, batch).block_until_ready(), reps)
    kernel_s = median_seconds(lambda: kernel(q, cache, batch).block_until_ready(), reps)
    return {"backend": backend, "interpret": interpret,
            "passed": all(c["passed"] for c in cases if c["gates"]), "cases": cases,
            "timing": {"rows": rows, "max_len": max_len,
                       "cached_tokens": int(np.sum(np.asarray(batch.lengths) + 1)),
                       "reference_ms": ref_s * 1e3, "kernel_ms": kernel_s * 1e3,
                       "kernel_speedup": ref_s / kernel_s}}


# -- prefix-reuse TTFT ---------------------------------------------------------------------------
def prefix_ttft(params, config: ModelConfig, cache_cfg: CacheConfig, prefix: int, suffix: int,
                reps: int) -> dict:
    """Cold vs warm time to first token in the engine (`stats["ttft_s"]`: submit to the first
    token sampled). Each repetition caches a fresh random prefix with one request (cold) and
    then sends the same prefix with another suffix (warm). A first pair, untimed, compiles."""
    need = pages_for(prefix + suffix + 1, cache_cfg.page_size)
    cc = dataclasses.replace(cache_cfg, num_pages=4 * need)
    t0 = time.perf_counter()
    engine = Engine(params, config, EngineConfig(cache=cc, max_slots=1, attention="reference"))
    init_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, config.vocab_size, n).tolist()

    def first_token(prompt: list[int]) -> dict:
        t = time.perf_counter()
        (result,) = engine.generate([Request(tokens=prompt, max_new_tokens=1)])
        return result.stats | {"wall_s": time.perf_counter() - t}

    runs = []
    for _ in range(reps + 1):
        shared = tokens(prefix)
        runs.append((first_token(shared + tokens(suffix)), first_token(shared + tokens(suffix))))
    cold, warm = zip(*runs[1:], strict=True)

    def med(stats, key: str) -> float:
        return statistics.median(s[key] for s in stats)

    return {"prefix_tokens": prefix, "suffix_tokens": suffix, "reps": reps,
            "prefill_chunk": cc.prefill_chunk, "engine_init_s": init_s,
            "cold_ttft_s": med(cold, "ttft_s"), "warm_ttft_s": med(warm, "ttft_s"),
            "speedup": med(cold, "ttft_s") / med(warm, "ttft_s"),
            "cold_wall_s": med(cold, "wall_s"), "warm_wall_s": med(warm, "wall_s"),
            "cold_reused_tokens": min(s["reused_tokens"] for s in cold),
            "warm_reused_tokens": min(s["reused_tokens"] for s in warm),
            "cold_computed_tokens": cold[0]["computed_tokens"],
            "warm_computed_tokens": warm[0]["computed_tokens"],
            "prefill_chunks_cold_over_warm":
                pages_for(cold[0]["computed_tokens"], cc.prefill_chunk)
                / pages_for(warm[0]["computed_tokens"], cc.prefill_chunk)}


# -- decode throughput -----------------------------------------------------------------------------
def decode_point(params, config: ModelConfig, holder: Holder, table, batch: int, context: int,
                 decode_steps: int, reps: int, kernel: AttentionKernel | None,
                 param_bytes: int, kv_bytes: int, peak: float | None) -> dict:
    seconds = decode_steps * multistep_seconds(params, config, holder, table[:batch],
                                               np.full(batch, context, np.int32),
                                               decode_steps, reps, kernel)
    moved = sum(memory.step_cost(config, batch, context + i, 1, param_bytes, kv_bytes).bytes
                for i in range(decode_steps))
    bandwidth = moved / seconds
    return {"backend": "reference" if kernel is None else kernel.backend,
            "seconds_per_call": seconds, "ms_per_step": seconds / decode_steps * 1e3,
            "tokens_per_s": batch * decode_steps / seconds,
            "bytes_per_step": moved / decode_steps, "hbm_bytes_per_s": bandwidth,
            "fraction_of_peak": None if peak is None else bandwidth / peak}


def decode_throughput(params, config: ModelConfig, cache_cfg: CacheConfig, batches: list[int],
                      context: int, decode_steps: int, reps: int, backend: str,
                      interpret: bool, peak: float | None, deadline: float) -> dict:
    """Decode tokens/s and achieved bandwidth per batch size, reference and kernel side by
    side, on one noise-filled cache sized for the largest batch (rows past `batch` idle).
    Stops before a batch size whose predicted time (the previous one's) passes `deadline`."""
    table, sized = contiguous_pages(cache_cfg, max(batches), context + decode_steps + 1)
    holder = Holder(filled_with_noise(init_cache(config, sized)))
    kernels = [None] + ([] if backend == "reference" else [AttentionKernel(backend, interpret)])
    param_bytes = jnp.dtype(config.dtype).itemsize
    kv_bytes = jnp.dtype(cache_cfg.dtype).itemsize
    points, skipped, last_s = [], [], 0.0
    with Progress(len(batches) * len(kernels), "decode") as bar:
        for b in batches:
            if skipped or time.perf_counter() + last_s > deadline:
                skipped.append(b)
                continue
            t0 = time.perf_counter()
            row = {"batch": b, "context": context, "steps": decode_steps}
            for kernel in kernels:
                result = decode_point(params, config, holder, table, b, context, decode_steps,
                                      reps, kernel, param_bytes, kv_bytes, peak)
                row["reference" if kernel is None else "kernel"] = result
                bar.update(1, batch=b, tokens_per_s=result["tokens_per_s"])
            if "kernel" in row:
                row["kernel_speedup"] = (row["reference"]["seconds_per_call"]
                                         / row["kernel"]["seconds_per_call"])
            points.append(row)
            last_s = time.perf_counter() - t0
    return {"points": points, "skipped_batches": skipped,
            "cache_pages": sized.num_pages, "page_size": sized.page_size,
            "note": (f"stopped before batch {', '.join(map(str, skipped))}: the time limit "
                     f"was near" if skipped else None)}
