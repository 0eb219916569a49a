"""KV memory calculator and prefill/decode cost explorer (plain Python, no JAX).

KV bytes = 2 (K and V) * batch * layers * length * kv_heads * head_dim * bytes_per_scalar,
where a quantized format's scales are part of bytes_per_scalar (`kv_bytes_per_scalar`).
That figure deliberately excludes page-table overhead, allocator rounding, temporary
workspaces and recurrent state; `kv_bytes_paged` adds the rounding of every sequence up to
whole pages. The per-device planner for a mesh is `kvjax.memory.planner`.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import ModelConfig

ASSUMPTIONS = (
    "KV bytes = 2 (K,V) x batch x layers x length x kv_heads x head_dim x bytes/scalar; "
    "int8 and float8 pages count their scales in bytes/scalar (1 + 4 / head_dim), "
    "int4_kivi pages theirs (0.5 + 2 / page_size + 2 / head_dim; not its open pages); "
    "excludes page-table overhead, allocator rounding (see the "
    "page-rounded figure), temporary workspaces and recurrent state."
)


# Bytes per stored number, and per scale of a (token, KV head) vector, of each page format
# (`CacheConfig.dtype`; int8 and float8 pages: kvjax.cache.paged). int4_kivi pages
# (kvjax.cache.kivi) group keys per channel over a page: None, see kv_bytes_per_scalar.
KV_FORMATS = {"float32": (4, 0), "bfloat16": (2, 0), "int8": (1, 4), "float8_e4m3fn": (1, 4),
              "int4_kivi": (0.5, None)}


def kv_bytes_per_scalar(cache_dtype: str, head_dim: int, page_size: int = 16) -> float:
    """Bytes per cached K or V number of `cache_dtype` pages, scales included: spread over
    the `head_dim` numbers each scales (int8, float8: 1 + 4 / head_dim); int4_kivi: keys
    0.5 + 4 / page_size (a float16 step and minimum per channel per page), values
    0.5 + 4 / head_dim (the same per token). (Its
    open pages, one float32 page per running row, are a fixed cost, not per token.)"""
    number, scale = KV_FORMATS[cache_dtype]
    if scale is None:
        return number + 2 / page_size + 2 / head_dim  # the mean of keys' and values'
    return number + scale / head_dim


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, length: int, batch: int = 1,
             bytes_per_scalar: float = 2) -> int:
    """Bytes of K and V for `batch` sequences of `length` tokens."""
    return round(2 * batch * num_layers * length * num_kv_heads * head_dim * bytes_per_scalar)


def windowed_pages(config: ModelConfig, length: int, page_size: int) -> dict[str, int]:
    """What sliding-window layers could give back in a sequence of `length` tokens: the
    pages each layer holds, and the pages wholly before a sliding layer's window for the
    next token (position `length` reads keys from `length - window + 1` on), which that
    layer never reads again. kvjax keeps one page table for every layer, so it frees none;
    this is the saving a per-layer table would have."""
    pages = -(-length // page_size)
    sliding = [w for w in config.windows if w is not None]
    stale = [max(0, (length - w + 1) // page_size) for w in sliding]
    return {"pages_per_layer": pages, "layers": config.num_layers,
            "sliding_layers": len(sliding),
            "freeable_per_sliding_layer": max(stale, default=0),
            "freeable_layer_pages": sum(stale),
            "layer_pages": pages * config.num_layers}


def kv_bytes_paged(num_layers: int, num_kv_heads: int, head_dim: int, length: int,
                   page_size: int, batch: int = 1, bytes_per_scalar: int = 2) -> int:
    """Like `kv_bytes`, with each sequence rounded up to whole pages."""
    rounded = -(-length // page_size) * page_size
    return kv_bytes(num_layers, num_kv_heads, head_dim, rounded, batch, bytes_per_scalar)


def param_counts(config: ModelConfig) -> dict[str, int]:
    """Parameter counts: matmul weights per layer, embeddings, output head, norms."""
    d, h = config.d_model, config.head_dim
    attn = d * h * (config.num_heads * 2 + config.num_kv_heads * 2)
    if config.qkv_bias:
        attn += h * (config.num_heads + 2 * config.num_kv_heads)
    if config.o_bias:
        attn += d
    gated = config.mlp in ("swiglu", "geglu")
    mlp = d * config.d_ff * (3 if gated else 2)
    if config.mlp_bias:
        mlp += config.d_ff * (2 if gated else 1) + d
    norms = d * (2 if config.norm == "rms" else 4) * (2 if config.sandwich_norms else 1)
    norms += 2 * h if config.qk_norm else 0
    embed = config.vocab_size * d
    return {
        "layer_matmul": attn + mlp,
        "layers": config.num_layers * (attn + mlp + norms),
        "embed": embed + (config.max_seq_len * d if config.position == "learned" else 0),
        "head": 0 if config.tie_embeddings else embed,
        "final_norm": d * (1 if config.norm == "rms" else 2),
    }


def num_params(config: ModelConfig) -> int:
    return sum(v for k, v in param_counts(config).items() if k != "layer_matmul")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Work of one step: FLOPs, bytes moved, and what bounds it on a given machine."""

    name: str
    tokens: int
    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        return "compute-bound" if self.intensity > peak_flops / bandwidth else "bandwidth-bound"

    def floor_seconds(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline lower bound on the step time."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)


def _attended(config: ModelConfig, position: int) -> int:
    """Keys a query at `position` attends to, summed over the layers."""
    keys = position + 1
    return sum(keys if w is None else min(keys, w) for w in config.windows)


def step_cost(config: ModelConfig, batch: int, context: int, new_tokens: int,
              param_bytes: int = 4, kv_bytes_per_scalar: int = 4) -> StepCost:
    """Cost of appending `new_tokens` per sequence to `batch` sequences holding `context`.

    new_tokens=1 is a decode step; new_tokens=T with context=0 is a prefill of T tokens.
    Weights are read once per step (they are shared by the batch); every sequence reads
    its own KV.
    """
    counts = param_counts(config)
    matmul = config.num_layers * counts["layer_matmul"] + config.vocab_size * config.d_model
    tokens = batch * new_tokens
    attn_flops = sum(4 * config.num_heads * config.head_dim
                     * _attended(config, context + t) for t in range(new_tokens))
    flops = 2.0 * matmul * tokens + batch * attn_flops
    read_weights = (config.num_layers * counts["layer_matmul"]
                    + config.vocab_size * config.d_model) * param_bytes
    kv_len = _attended(config, context + new_tokens - 1) / config.num_layers  # per layer
    per_token_kv = kv_bytes(config.num_layers, config.num_kv_heads, config.head_dim, 1, 1,
                            kv_bytes_per_scalar)
    name = "decode" if new_tokens == 1 else ("prefill" if context == 0 else "extend")
    return StepCost(name=name, tokens=tokens, flops=flops, weight_bytes=read_weights,
                    kv_read_bytes=batch * kv_len * per_token_kv,
                    kv_write_bytes=tokens * per_token_kv)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def report(config: ModelConfig, batch: int, context: int, page_size: int,
           kv_bytes_per_scalar: int, param_bytes: int, prefill_tokens: int,
           peak_flops: float, bandwidth: float) -> str:
    """A printable memory and cost report."""
    per_token = kv_bytes(config.num_layers, config.num_kv_heads, config.head_dim, 1, 1,
                         kv_bytes_per_scalar)
    exact = kv_bytes(config.num_layers, config.num_kv_heads, config.head_dim, context, batch,
                     kv_bytes_per_scalar)
    paged = kv_bytes_paged(config.num_layers, config.num_kv_heads, config.head_dim, context,
                           page_size, batch, kv_bytes_per_scalar)
    lines = [
        f"model: {config.num_layers} layers, d_model {config.d_model}, {config.num_heads} "
        f"heads, {config.num_kv_heads} kv heads, head_dim {config.head_dim}, "
        f"{num_params(config):,} params",
        f"assumptions: {ASSUMPTIONS}",
        f"KV per token per sequence: {human_bytes(per_token)} ({per_token:,} B)",
        f"KV per generated token at batch {batch}: {human_bytes(per_token * batch)}",
        f"KV at batch {batch} x context {context}: {human_bytes(exact)} ({exact:,} B)",
        f"  page-rounded (page_size {page_size}): {human_bytes(paged)} ({paged:,} B)",
        f"machine assumed: {peak_flops / 1e9:,.0f} GFLOP/s peak, {bandwidth / 1e9:,.1f} GB/s "
        f"(balance {peak_flops / bandwidth:,.1f} FLOP/B)",
        f"{'step':<8} {'tokens':>7} {'GFLOP':>9} {'MB moved':>9} {'FLOP/B':>8} "
        f"{'floor ms':>9}  bound",
    ]
    for cost in (step_cost(config, 1, 0, prefill_tokens, param_bytes, kv_bytes_per_scalar),
                 step_cost(config, batch, context, 1, param_bytes, kv_bytes_per_scalar)):
        lines.append(
            f"{cost.name:<8} {cost.tokens:>7} {cost.flops / 1e9:>9.2f} {cost.bytes / 1e6:>9.1f} "
            f"{cost.intensity:>8.1f} {cost.floor_seconds(peak_flops, bandwidth) * 1e3:>9.2f}"
            f"  {cost.bound(peak_flops, bandwidth)}")
    return "\n".join(lines)
