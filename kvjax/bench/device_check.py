"""`scripts/device_check`: one run on a GPU machine that checks and measures what CPUs cannot.

Three phases, each printed as it runs, all written to one JSON file:
  kernel   the decode-attention kernel against `paged_attention_reference` on the device
           (random GQA queries and a paged cache with ragged lengths; pass: within the
           tolerance of `kvjax.model.kernels`, abs and rel), and both timed alone.
  ttft     prefix reuse in the engine: time to first token of a request whose long prompt
           prefix is already cached (warm) against the same-sized request cold.
  decode   `steps.decode_loop` with random bfloat16 weights of the 8B config: tokens/s and
           achieved HBM bandwidth per batch size, reference attention and the kernel side by
           side. Bytes per step are those `memory.step_cost` counts (weights once, every
           row's KV, the new KV written); bandwidth = bytes / measured seconds.
Every time is a median of timed repetitions after warm-up (`kvjax.lab.timing.median_seconds`).
`--tiny` runs a small model on CPU in seconds (kernels in Pallas interpret mode): the test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache.paged import BatchInfo, PagedKVCache, init_cache
from kvjax.config import CacheConfig, EngineConfig, ModelConfig, load_config
from kvjax.decode.batching import page_table, pages_for
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, environment, markdown_table, refuse
from kvjax.lab.timing import (
    Holder,
    contiguous_pages,
    filled_with_noise,
    median_seconds,
    multistep_seconds,
)
from kvjax.model.attention import paged_attention_reference
from kvjax.model.kernels import (
    BACKENDS,
    TOLERANCE,
    AttentionKernel,
    kernel_limits,
    paged_decode_attention,
    resolve_backend,
)
from kvjax.model.transformer import param_shapes

# Peak HBM bandwidth in bytes/s from vendor spec sheets, matched in order against
# `device_kind` (e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3"); unknown kinds report null.
PEAK_HBM = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
            ("A100-SXM4-80GB", 2.039e12))

# XLA's RngBitGenerator: random values for timing compile in a fraction of threefry's time.
RNG = "unsafe_rbg"

TINY_MODEL = ModelConfig(vocab_size=256, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                         d_ff=128, max_seq_len=512, dtype="bfloat16")

# Sizes by preset; an explicit option overrides its preset value.
PRESETS = {
    "full": dict(batches="1,8,64", context=1024, steps=64, reps=3, prefix=2048, suffix=64,
                 prefill_chunk=256, kernel_rows=16, kernel_max_len=2048),
    "tiny": dict(batches="1,2", context=32, steps=8, reps=2, prefix=64, suffix=8,
                 prefill_chunk=32, kernel_rows=4, kernel_max_len=64),
}

NO_GPU = ("kvjax device_check measures an 8B model on a GPU, and JAX sees no accelerator here "
          "(backend 'cpu'). Run it on a GPU machine, `--tiny` for a small CPU run, or "
          "`--force` to run the full sizes anyway.")


def peak_hbm(device_kind: str) -> float | None:
    for name, peak in PEAK_HBM:
        if name in device_kind:
            return peak
    return None


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


DECODE_COLUMNS = [
    ("batch", lambda r: str(r["batch"])),
    ("backend", lambda r: r["backend"]),
    ("ms/step", lambda r: f"{r['ms_per_step']:.2f}"),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("GB/s", lambda r: f"{r['hbm_bytes_per_s'] / 1e9:,.0f}"),
    ("of peak", lambda r: "-" if r["fraction_of_peak"] is None
     else f"{r['fraction_of_peak']:.0%}"),
    ("kernel speedup", lambda r: r["speedup"]),
]


def summary(report: dict) -> str:
    """The printed digest of a report."""
    lines = []
    k = report["kernel_check"]
    if k.get("skipped"):
        lines.append(f"kernel: skipped ({k['skipped']})")
    else:
        for c in k["cases"]:
            verdict = "PASS" if c["passed"] else "FAIL"
            lines.append(f"kernel {k['backend']} {c['q_dtype']} q / {c['cache_dtype']} cache, "
                         f"{c['precision']} precision: max abs error {c['max_abs_error']:.2e} "
                         f"(tol {c['tol']:g}) {verdict if c['gates'] else verdict.lower()}"
                         f"{'' if c['gates'] else ' (reported, not gated)'}; vs exact: kernel "
                         f"{c['kernel_vs_exact']:.1e}, reference {c['reference_vs_exact']:.1e}")
        t = k["timing"]
        lines.append(f"kernel alone: {t['kernel_ms']:.3f} ms vs reference {t['reference_ms']:.3f}"
                     f" ms ({t['kernel_speedup']:.2f}x), {t['rows']} rows")
    p = report["prefix_ttft"]
    lines.append(f"TTFT, {p['prefix_tokens']}-token cached prefix + {p['suffix_tokens']}: warm "
                 f"{p['warm_ttft_s'] * 1e3:.1f} ms vs cold {p['cold_ttft_s'] * 1e3:.1f} ms "
                 f"({p['speedup']:.1f}x; {p['warm_reused_tokens']} tokens reused)")
    rows = []
    for point in report["decode"]["points"]:
        for name in ("reference", "kernel"):
            if name in point:
                speedup = f"{point['kernel_speedup']:.2f}x" if name == "kernel" else ""
                rows.append(point[name] | {"batch": point["batch"], "speedup": speedup})
    lines.append("\n" + markdown_table(rows, DECODE_COLUMNS))
    if report["decode"]["note"]:
        lines.append(report["decode"]["note"])
    return "\n".join(lines)


def preset(key: str) -> str:
    """An option's defaults, for its help."""
    return f"default {PRESETS['full'][key]}; --tiny {PRESETS['tiny'][key]}"


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/device_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="device_check.json", help="the JSON report")
    p.add_argument("--config", default="configs/models/llama3_8b.toml",
                   help="the model: [model] of a TOML file, run in bfloat16 (ignored with --tiny)")
    p.add_argument("--batches", help=f"decode batch sizes ({preset('batches')})")
    p.add_argument("--context", type=int,
                   help=f"tokens cached per row when decode is timed ({preset('context')})")
    p.add_argument("--steps", type=int, help=f"decode steps per timed call ({preset('steps')})")
    p.add_argument("--reps", type=int, help=f"timed repetitions, medians ({preset('reps')})")
    p.add_argument("--prefix", type=int,
                   help=f"cached prefix tokens of the TTFT requests ({preset('prefix')})")
    p.add_argument("--suffix", type=int, help=f"tokens after the prefix ({preset('suffix')})")
    p.add_argument("--prefill-chunk", type=int,
                   help=f"the engine's prefill chunk ({preset('prefill_chunk')})")
    p.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                   help="the decode kernel (auto: the device's; on a CPU with --tiny, "
                        "pallas_gpu in interpret mode)")
    p.add_argument("--tiny", action="store_true",
                   help="a small model and sizes (CPU, seconds; kernels in interpret mode)")
    p.add_argument("--time-limit-s", type=float, default=540.0,
                   help="seconds from the start: skip the decode batch sizes that would end "
                        "past this (default 540)")
    p.add_argument("--force", action="store_true", help="run the full sizes on a CPU")
    args = p.parse_args(argv)
    for key, value in PRESETS["tiny" if args.tiny else "full"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    return args


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    platform = jax.default_backend()
    if platform == "cpu" and not (args.tiny or args.force):
        hint = (f' An NVIDIA driver is present: install the CUDA build of JAX, e.g. '
                f'`pip install -U "jax[cuda13]=={jax.__version__}"`.'
                if shutil.which("nvidia-smi") else "")
        return refuse(NO_GPU + hint)
    if args.tiny:
        model = TINY_MODEL
        cache_cfg = CacheConfig(page_size=16, num_pages=1, dtype="bfloat16",
                                prefill_chunk=args.prefill_chunk, attn_block=32)
    else:
        model = dataclasses.replace(load_config(args.config).model, dtype="bfloat16")
        cache_cfg = CacheConfig(page_size=16, num_pages=1, dtype="bfloat16",
                                prefill_chunk=args.prefill_chunk, attn_block=64)
    # On a CPU (`--tiny`) "auto" checks the GPU kernel, in interpret mode.
    backend = resolve_backend(args.backend, model, "gpu" if platform == "cpu" else None,
                              cache=cache_cfg)
    interpret = platform == "cpu"
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", str(device))
    peak = peak_hbm(kind)
    emit(f"device_check: {kind} ({platform}); model {'tiny' if args.tiny else args.config}: "
         f"{model.num_layers} layers, d_model {model.d_model}, {model.num_heads}/"
         f"{model.num_kv_heads} heads, {memory.num_params(model):,} params in {model.dtype}; "
         f"kernel {backend}{' (interpret)' if interpret and backend != 'reference' else ''}")

    emit("[1/3] kernel vs reference")
    kernel = check_kernel(model, cache_cfg, backend, interpret, args.kernel_rows,
                          args.kernel_max_len, args.reps)
    emit(f"[2/3] random {model.dtype} weights, prefix-reuse TTFT "
         f"({time.perf_counter() - start:.0f} s)")
    params = jax.block_until_ready(random_params(model))
    ttft = prefix_ttft(params, model, cache_cfg, args.prefix, args.suffix, args.reps)
    emit(f"[3/3] decode at batch {', '.join(map(str, args.batches))}, context {args.context}, "
         f"{args.steps} steps per call ({time.perf_counter() - start:.0f} s)")
    decode = decode_throughput(params, model, cache_cfg, args.batches, args.context,
                               args.steps, args.reps, backend, interpret, peak,
                               start + args.time_limit_s)
    stats = device.memory_stats() or {}
    report = {
        "passed": kernel["passed"],
        "total_s": time.perf_counter() - start,
        "settings": {k: v for k, v in vars(args).items() if k != "force"}
        | ({"config": None} if args.tiny else {}),
        "device": {"kind": kind, "platform": platform, "peak_hbm_bytes_per_s": peak,
                   "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                   "bytes_limit": stats.get("bytes_limit")},
        "model": dataclasses.asdict(model) | {"num_params": memory.num_params(model),
                                              "cache": dataclasses.asdict(cache_cfg)},
        "kernel_check": kernel,
        "prefix_ttft": ttft,
        "decode": decode,
        "environment": environment(),
    }
    emit("\n" + summary(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    emit(f"\nwrote {out} ({report['total_s']:.0f} s)")
    return 0 if kernel["passed"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
