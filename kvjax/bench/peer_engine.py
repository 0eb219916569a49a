"""kvjax's Engine beside llama.cpp on a real model (`scripts/bench peer --model NAME --with
llama.cpp`): the columns of the issue's table that `generate` alone does not have.

Engine defaults (8 slots, invariant numerics, prefix cache on) with a pool large enough
for the workloads; greedy, EOS ignored. Per system: a lone request (prefill of the prompt,
decode tokens/s, end to end; a fresh random prompt each repetition, so nothing is reused),
a warm shared-prefix request (`SHARED` cached tokens + `OWN` new ones, one new token: the
steady state of repeated requests over one long system prompt) and a cold one (the same
size, nothing cached), and the weight bandwidth of decode (the model's weight bytes read
once per token x decode tokens/s). For the Engine also the aggregate decode tokens/s of
`CONCURRENT` requests at once (the issue's goal: at least 4x llama.cpp's single sequence).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from kvjax.config import CacheConfig, EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.requests import Request

SHARED, OWN, SUFFIXES, CONCURRENT = 1024, 32, 6, 8


def weight_bytes(params) -> int:
    """Bytes of every parameter (a decode token reads each once; the tied embedding is the
    head)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def prefix_workload(vocab: int, seed: int = 1) -> dict:
    """{"shared": SHARED ids, "suffixes": SUFFIXES lists of OWN ids} (random)."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    return {"shared": ids(SHARED), "suffixes": [ids(OWN) for _ in range(SUFFIXES)]}


def engine_figures(params, config, prompt_len: int, new_tokens: int, reps: int,
                   prefix: dict, cpu_kernel: str = "off") -> dict:
    """The Engine's figures (see the module docstring), in seconds and tokens/s, with
    `EngineConfig.cpu_kernel` set to `cpu_kernel` ("auto:unrolled": auto without the layer
    loop)."""
    rng = np.random.default_rng(2)
    kernel, _, form = cpu_kernel.partition(":")
    engine = Engine(params, config, EngineConfig(cache=CacheConfig(num_pages=1024),
                                                 cpu_kernel=kernel,
                                                 layer_loop=form != "unrolled"))

    def request(tokens, n):
        return Request(tokens=list(map(int, tokens)), max_new_tokens=n, ignore_eos=True)

    def lone(n):
        start = time.perf_counter()
        (res,) = engine.generate([request(rng.integers(0, config.vocab_size, prompt_len), n)])
        return time.perf_counter() - start, res.stats["ttft_s"]

    lone(2), lone(new_tokens)  # compiles
    runs = [lone(new_tokens) for _ in range(reps)]
    total, ttft = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    shared, suffixes = prefix["shared"], prefix["suffixes"]
    fresh = rng.integers(0, config.vocab_size, len(shared)).tolist()
    _timed(engine, [request(fresh + suffixes[0], 1)])  # compiles the cold calls
    _timed(engine, [request(fresh + suffixes[1], 1)])  # and the warm tail's
    cold, warm = [], []
    for s in suffixes:  # a fresh shared part: nothing to reuse
        fresh = rng.integers(0, config.vocab_size, len(shared)).tolist()
        cold.append(_timed(engine, [request(fresh + s, 1)]))
    _timed(engine, [request(shared + suffixes[0], 1)])  # the shared prefix is now cached
    warm = [_timed(engine, [request(shared + s, 1)]) for s in suffixes[1:]]
    many = [request(rng.integers(0, config.vocab_size, prompt_len), new_tokens)
            for _ in range(CONCURRENT)]
    _timed(engine, many)  # compiles the 8-row steps
    start = time.perf_counter()
    results = engine.generate([request(r.tokens, new_tokens) for r in many])
    elapsed = time.perf_counter() - start
    last_first = max(r.stats["ttft_s"] for r in results)
    return {"engine_prefill_s": ttft, "engine_total_s": total,
            "engine_decode_tok_s": (new_tokens - 1) / max(total - ttft, 1e-9),
            "engine_cold_s": statistics.median(cold), "engine_warm_s": statistics.median(warm),
            "engine_aggregate_tok_s": CONCURRENT * (new_tokens - 1) / max(elapsed - last_first,
                                                                           1e-9)}


def _timed(engine: Engine, requests: list[Request]) -> float:
    start = time.perf_counter()
    engine.generate(requests)
    return time.perf_counter() - start


def table(row: dict, gigabytes: float) -> str:
    """The Markdown table of the batch-1 row's kvjax.generate, Engine and llama.cpp figures."""
    def gbs(tok_s):
        return f"{tok_s * gigabytes:.1f}"

    lines = ["| system | prefill s | decode tok/s | GB/s | end-to-end s | warm shared-prefix s "
             "| cold request s |", "|---|---:|---:|---:|---:|---:|---:|"]
    systems = [("llama.cpp (llama-cpp-python), f32 GGUF", "llamacpp"),
               ("transformers, f32", "hf"), ("`kvjax.generate`, f32", "kvjax"),
               ("`kvjax.Engine` (defaults), f32", "engine")]
    if "cpu_kernel" in row:  # kvjax's rows say which setting they ran
        systems = [(name.replace(", f32", f", cpu_kernel={row['cpu_kernel']}, f32")
                    if key in ("kvjax", "engine") else name, key) for name, key in systems]
    for name, key in systems:
        warm, cold = row.get(f"{key}_warm_s"), row.get(f"{key}_cold_s")
        lines.append(
            f"| {name} | {row[f'{key}_prefill_s']:.2f} | {row[f'{key}_decode_tok_s']:.1f} | "
            f"{gbs(row[f'{key}_decode_tok_s'])} | {row[f'{key}_total_s']:.2f} | "
            f"{'-' if warm is None else f'{warm * 1e3:.0f} ms'} | "
            f"{'-' if cold is None else f'{cold * 1e3:.0f} ms'} |")
    lines.append(f"\nEngine, {CONCURRENT} concurrent requests: "
                 f"{row['engine_aggregate_tok_s']:.1f} decode tok/s in all = "
                 f"{row['engine_aggregate_tok_s'] / row['llamacpp_decode_tok_s']:.2f}x "
                 f"llama.cpp's single sequence")
    return "\n".join(lines)
