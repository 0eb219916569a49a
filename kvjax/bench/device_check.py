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
The phases run in `kvjax.bench.device_measure`; the printed digest is
`kvjax.bench.device_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import jax

from kvjax import memory
from kvjax.bench.device_measure import (
    check_kernel,
    decode_throughput,
    prefix_ttft,
    random_params,
)
from kvjax.bench.device_report import summary
from kvjax.config import CacheConfig, ModelConfig
from kvjax.config_files import load_config
from kvjax.decode import compile_cache
from kvjax.lab.report import emit, environment, refuse
from kvjax.model.kernels import BACKENDS, resolve_backend

# Peak HBM bandwidth in bytes/s from vendor spec sheets, matched in order against
# `device_kind` (e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3"); unknown kinds report null.
PEAK_HBM = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
            ("A100-SXM4-80GB", 2.039e12))

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
    compile_cache.enable()
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
