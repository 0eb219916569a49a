"""Decode benchmark: paged vs dense-cache vs no-cache recomputation, side by side in one run.

Every figure is a median of timed repetitions after warm-up, with `block_until_ready`.
Ratios are computed inside the run (absolute times drift between machines and runs). The
batch-1 step is compared with its memory-bandwidth floor: bytes of weights + KV read per
step divided by the bandwidth a jitted matrix-vector product reaches on this machine.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache.dense import init_dense_cache
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, ModelConfig
from kvjax.config_files import load_config
from kvjax.decode import steps
from kvjax.decode.sampling import sample_jit, sampling_rows
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.lab.timing import (
    Holder,
    contiguous_pages,
    filled_with_noise,
    measure_bandwidth,
    median_seconds,
    multistep_seconds,
)
from kvjax.model.transformer import forward, init_params


def _step_timer(params, config, holder, tokens, batch):
    def run():
        holder.run(lambda cache: steps.extend(params, config, cache, tokens, batch)
                   ).block_until_ready()

    return run


def bench_point(params, config: ModelConfig, cache_cfg: CacheConfig, batch: int, context: int,
                decode_steps: int, reps: int, bandwidth: float) -> dict:
    """All measurements at one (batch, context) point."""
    total = context + decode_steps + 1
    table, paged_cfg = contiguous_pages(cache_cfg, batch, total)
    lengths = np.full(batch, context, np.int32)
    one = np.ones(batch, np.int32)
    tokens = np.ones((batch, 1), np.int32)
    decode_batch = BatchInfo(page_table=table, lengths=lengths, num_new=one)

    paged = Holder(filled_with_noise(init_cache(config, paged_cfg)))
    paged_s = median_seconds(_step_timer(params, config, paged, tokens, decode_batch), reps)

    dense = Holder(filled_with_noise(init_dense_cache(config, batch, total, cache_cfg.dtype)))
    dense_s = median_seconds(_step_timer(params, config, dense, tokens, decode_batch), reps)

    # Multi-step decode on device vs one jitted call per token from Python.
    multi_s = multistep_seconds(params, config, paged, table, lengths, decode_steps, reps)
    keys, knobs = np.zeros((batch, 2), np.uint32), sampling_rows([], batch)

    def python_loop():
        last = tokens
        for i in range(decode_steps):
            b = BatchInfo(page_table=table, lengths=lengths + i, num_new=one)
            logits = paged.run(lambda cache, last=last, b=b: steps.extend(
                params, config, cache, last, b))
            nxt = sample_jit(logits[:, 0], keys, lengths + i + 1, *knobs)
            last = np.asarray(nxt)[:, None]  # the host needs each token (stop checks)

    loop_s = median_seconds(python_loop, max(1, reps // 2), warmup=1) / decode_steps

    ids = jnp.ones((batch, context + 1), jnp.int32)
    nocache_reps = 3 if batch * context >= 8192 else reps
    nocache_s = median_seconds(lambda: forward(params, config, ids).block_until_ready(),
                                nocache_reps, warmup=1)

    cost = memory.step_cost(config, batch, context, 1, param_bytes=4,
                            kv_bytes_per_scalar=jnp.dtype(cache_cfg.dtype).itemsize)
    floor_s = (cost.weight_bytes + cost.kv_read_bytes) / bandwidth
    return {
        "batch": batch, "context": context,
        "paged_step_ms": paged_s * 1e3, "dense_step_ms": dense_s * 1e3,
        "paged_over_dense": paged_s / dense_s,
        "nocache_ms_per_token": nocache_s * 1e3,
        "nocache_over_paged": nocache_s / paged_s,
        "multistep_ms_per_token": multi_s * 1e3,
        "python_loop_ms_per_token": loop_s * 1e3,
        "python_loop_over_multistep": loop_s / multi_s,
        "floor_ms": floor_s * 1e3,
        "multistep_over_floor": multi_s / floor_s,
        "bytes_per_step": cost.weight_bytes + cost.kv_read_bytes,
    }


COLUMNS = [
    ("batch", lambda r: str(r["batch"])),
    ("context", lambda r: str(r["context"])),
    ("paged ms/step", lambda r: f"{r['paged_step_ms']:.2f}"),
    ("dense ms/step", lambda r: f"{r['dense_step_ms']:.2f}"),
    ("paged/dense", lambda r: f"{r['paged_over_dense']:.2f}x"),
    ("no-cache ms/token", lambda r: f"{r['nocache_ms_per_token']:.1f}"),
    ("no-cache/paged", lambda r: f"{r['nocache_over_paged']:.1f}x"),
    ("multi-step ms/token", lambda r: f"{r['multistep_ms_per_token']:.2f}"),
    ("Python-loop ms/token", lambda r: f"{r['python_loop_ms_per_token']:.2f}"),
    ("loop/multi-step", lambda r: f"{r['python_loop_over_multistep']:.2f}x"),
    ("floor ms", lambda r: f"{r['floor_ms']:.2f}"),
    ("multi-step/floor", lambda r: f"{r['multistep_over_floor']:.2f}x"),
]


def main(args) -> int:
    config = load_config(args.config, args.set)
    model, cache_cfg = config.model, config.cache
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    emit(f"bench: {args.config}: {model.num_layers} layers, d_model {model.d_model}, "
          f"{model.num_heads}/{model.num_kv_heads} heads, vocab {model.vocab_size}, "
          f"{memory.num_params(model):,} params, cache {cache_cfg.dtype}, page_size "
          f"{cache_cfg.page_size}, attn_block {cache_cfg.attn_block}")
    bandwidth = measure_bandwidth()
    emit(f"measured matvec bandwidth: {bandwidth / 1e9:.1f} GB/s")
    params = init_params(model, seed=0)
    results = []
    points = [(b, c) for b in batches for c in contexts]
    for i, (b, c) in enumerate(points, 1):
        t0 = time.perf_counter()
        results.append(bench_point(params, model, cache_cfg, b, c, args.steps, args.reps,
                                   bandwidth))
        emit(f"[{i}/{len(points)}] batch {b}, context {c}: paged "
              f"{results[-1]['paged_step_ms']:.2f} ms/step, dense "
              f"{results[-1]['dense_step_ms']:.2f} ms/step ({time.perf_counter() - t0:.0f} s)")
    write_results(args.out, markdown_table(results, COLUMNS), results, config=args.config,
                  overrides=args.set, bandwidth_gbs=bandwidth / 1e9, steps=args.steps,
                  reps=args.reps, jax=jax.__version__)
    return 0
