"""KV memory calculator, prefill/decode cost explorer and per-device planner for a mesh.

KV bytes = 2 (K and V) * batch * layers * length * kv_heads * head_dim * bytes_per_scalar.
That figure deliberately excludes page-table overhead, quantization scales, allocator
rounding, temporary workspaces and recurrent state; `kv_bytes_paged` adds the rounding of
every sequence up to whole pages.

The calculator is plain arithmetic. The planner (`plan`, `plan_report`, `scale_table`)
prices a ("data", "model") mesh this machine need not have: it builds the parameter tree
with `jax.eval_shape` (nothing allocated) and splits every array by the rules table of
`kvjax.sharding`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import sharding
from kvjax.config import ConfigError, ModelConfig
from kvjax.model.transformer import init_params

ASSUMPTIONS = (
    "KV bytes = 2 (K,V) x batch x layers x length x kv_heads x head_dim x bytes/scalar; "
    "excludes page-table overhead, quantization scales, allocator rounding (see the "
    "page-rounded figure), temporary workspaces and recurrent state."
)


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, length: int, batch: int = 1,
             bytes_per_scalar: int = 2) -> int:
    """Bytes of K and V for `batch` sequences of `length` tokens."""
    return 2 * batch * num_layers * length * num_kv_heads * head_dim * bytes_per_scalar


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
    mlp = d * config.d_ff * (3 if config.mlp == "swiglu" else 2)
    if config.mlp_bias:
        mlp += config.d_ff * (2 if config.mlp == "swiglu" else 1) + d
    norms = d * (2 if config.norm == "rms" else 4)
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
    """Keys a query at `position` attends to."""
    keys = position + 1
    return keys if config.sliding_window is None else min(keys, config.sliding_window)


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
    attn_flops = sum(4 * config.num_layers * config.num_heads * config.head_dim
                     * _attended(config, context + t) for t in range(new_tokens))
    flops = 2.0 * matmul * tokens + batch * attn_flops
    read_weights = (config.num_layers * counts["layer_matmul"]
                    + config.vocab_size * config.d_model) * param_bytes
    kv_len = min(context + new_tokens, config.sliding_window or context + new_tokens)
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


GIB = 2**30
PLAN_CONTEXTS = (2048, 8192, 32768, 131072)  # the "largest batch by context" rows
TABLE_MESHES = ("model=1", "model=8", "data=2,model=4")
LARGE_CONFIGS = ("configs/models/llama3_8b.toml", "configs/models/llama3_70b.toml")

PLAN_ASSUMPTIONS = (
    "every sequence stores the KV of all its tokens, rounded up to whole pages, with no "
    "prefix sharing; the reserve stands for activations, logits and XLA workspace (an "
    "assumption, not measured)."
)


@functools.lru_cache(maxsize=8)
def param_shapes(config: ModelConfig):
    """The parameter tree of `config` as shapes only (`jax.eval_shape`: nothing allocated)."""
    return jax.eval_shape(lambda: init_params(config))


def _scalars(shape: tuple[int, ...], spec, sizes: dict[str, int]) -> int:
    """Scalars one device holds of an array (its shard bytes at one byte per scalar)."""
    return sharding.shard_bytes(shape, np.uint8, spec, sizes)


def weight_bytes_per_device(config: ModelConfig, sizes: dict[str, int], param_bytes: int,
                            notes: list[str] | None = None) -> int:
    """Bytes of weights one device holds on a mesh of `sizes`, at `param_bytes` per weight.

    init_params makes float32 weights; a served model stores them in its own dtype, so the
    width is an argument rather than the traced dtype.
    """
    shapes = param_shapes(config)
    specs = sharding.param_specs(shapes, sizes, notes)
    per_leaf = jax.tree.map(lambda x, spec: _scalars(x.shape, spec, sizes), shapes, specs)
    return param_bytes * sum(jax.tree.leaves(per_leaf))


def kv_bytes_per_token_per_device(config: ModelConfig, sizes: dict[str, int],
                                  kv_bytes_per_scalar: int,
                                  notes: list[str] | None = None) -> int:
    """K and V bytes one token adds on each device: KV heads split over "model" (or not)."""
    spec = sharding.cache_spec(config, sizes, notes)
    one_token = (config.num_layers, config.num_kv_heads, 1, 1, config.head_dim)  # [L, K, 1, 1, H]
    return 2 * kv_bytes_per_scalar * _scalars(one_token, spec, sizes)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan(config: ModelConfig, mesh: str | dict[str, int] = "model=1",
         device_memory: int = 80 * GIB, kv_bytes_per_scalar: int = 2,
         param_bytes: int | None = None, page_size: int = 16, reserve: float = 0.1,
         batch: int = 1, context: int = 8192,
         contexts: tuple[int, ...] = PLAN_CONTEXTS) -> dict:
    """Per-device memory of serving `config` on `mesh`, and the largest batch x context.

    Weights and KV are split as `kvjax.sharding` places them. The page pool is not split
    over "data": every data shard holds the whole pool, so batch B at context C costs
    B * C (page-rounded) * the per-device KV per token on every device. The KV budget is
    `device_memory` less `reserve` (a fraction) less the weights. `param_bytes` None: the
    width of `config.dtype`.
    """
    sizes = sharding.parse_mesh(mesh)
    if param_bytes is None:
        param_bytes = jnp.dtype(config.dtype).itemsize
    for key, value in (("device_memory", device_memory), ("page_size", page_size),
                       ("batch", batch), ("context", context), ("param_bytes", param_bytes),
                       ("kv_bytes_per_scalar", kv_bytes_per_scalar)):
        if value < 1:
            raise ConfigError(key, f"must be >= 1, got {value}")
    if not 0 <= reserve < 1:
        raise ConfigError("reserve", f"must be in [0, 1), got {reserve}")
    notes: list[str] = []
    weights = weight_bytes_per_device(config, sizes, param_bytes, notes)
    kv_token = kv_bytes_per_token_per_device(config, sizes, kv_bytes_per_scalar, notes)
    unsharded = kv_bytes(config.num_layers, config.num_kv_heads, config.head_dim, 1, 1,
                         kv_bytes_per_scalar)
    reserve_bytes = round(device_memory * reserve)
    budget = device_memory - reserve_bytes - weights  # may be negative: weights do not fit

    def max_batch(ctx: int) -> int:
        return max(0, budget // (_round_up(ctx, page_size) * kv_token))

    def max_context(rows: int) -> int:
        return max(0, budget // (rows * kv_token) // page_size * page_size)

    kv_used = batch * _round_up(context, page_size) * kv_token
    return {
        "mesh": sizes,
        "devices": math.prod(sizes.values()),
        "device_memory": device_memory,
        "reserve": reserve,
        "reserve_bytes": reserve_bytes,
        "param_bytes": param_bytes,
        "kv_bytes_per_scalar": kv_bytes_per_scalar,
        "page_size": page_size,
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_token,
        "kv_bytes_per_token_unsharded": unsharded,
        "kv_split": unsharded // kv_token,
        "kv_replicated": sizes["model"] > 1 and kv_token == unsharded,
        "kv_budget": budget,
        "batch": batch,
        "context": context,
        "kv_bytes": kv_used,
        "fits": kv_used <= budget,
        "max_batch": max_batch(context),
        "max_context": max_context(batch),
        "max_batch_by_context": {ctx: max_batch(ctx) for ctx in contexts},
        "notes": notes,
    }


def mesh_label(sizes: dict[str, int]) -> str:
    return ", ".join(f"{axis}={n}" for axis, n in sizes.items())


def plan_report(config: ModelConfig, **kwargs) -> str:
    """A printable per-device plan; `kwargs` are those of `plan`."""
    p = plan(config, **kwargs)
    data, model = p["mesh"]["data"], p["mesh"]["model"]
    beyond = f"beyond max_seq_len {config.max_seq_len:,}"
    devices = f"{p['devices']} device" + ("s" if p["devices"] > 1 else "")
    placed = (f"heads, kv_heads, ff and vocab split over model={model}, norms replicated"
              if model > 1 else "no model axis: every device holds all of them")
    lines = [
        f"per-device plan on mesh {mesh_label(p['mesh'])} ({devices}), "
        f"{human_bytes(p['device_memory'])} per device",
        f"plan assumptions: {PLAN_ASSUMPTIONS}",
        f"weights per device: {human_bytes(p['weight_bytes'])} ({p['weight_bytes']:,} B) at "
        f"{p['param_bytes']} B/weight; {placed}",
    ]
    if p["kv_replicated"]:
        split = f"not split: the KV heads are replicated on model={model}"
    elif model == 1:
        split = "no model axis: every device holds all KV heads"
    else:
        split = f"{p['kv_bytes_per_token_unsharded']:,} B / {p['kv_split']} KV-head shards"
    lines.append(f"KV per token per device: {human_bytes(p['kv_bytes_per_token'])} "
                 f"({p['kv_bytes_per_token']:,} B; {split})")
    if data > 1:
        lines.append(f"data={data}: weights and the page pool are replicated over data; every "
                     f"data shard holds the whole pool, so data adds decode rows, not KV "
                     f"capacity: KV for batch B x context C is B x C x "
                     f"{p['kv_bytes_per_token']:,} B on every device")
    lines.append(f"reserve: {p['reserve']:.0%} ({human_bytes(p['reserve_bytes'])}) for "
                 f"activations, logits and XLA workspace")
    if p["kv_budget"] <= 0:
        lines.append(f"weights do not fit: {human_bytes(p['weight_bytes'])} > "
                     f"{human_bytes(p['device_memory'] - p['reserve_bytes'])} (device memory "
                     f"less reserve); use a larger model axis")
        return "\n".join(lines + [f"note: {n}" for n in p["notes"]])
    lines += [
        f"KV budget per device: {human_bytes(p['kv_budget'])} (memory - reserve - weights)",
        f"KV at batch {p['batch']} x context {p['context']:,} (page-rounded): "
        f"{human_bytes(p['kv_bytes'])}: {'fits' if p['fits'] else 'does not fit'}",
        f"largest batch at context {p['context']:,}: {p['max_batch']:,}",
        f"largest context at batch {p['batch']}: {p['max_context']:,} tokens (page-rounded"
        + (f"; {beyond})" if p["max_context"] > config.max_seq_len else ")"),
        f"{'context':>9} {'max batch':>10}",
    ]
    for ctx, rows in p["max_batch_by_context"].items():
        lines.append(f"{ctx:>9,} {rows:>10,}" + (f"  ({beyond})" if ctx > config.max_seq_len
                                                 else ""))
    return "\n".join(lines + [f"note: {n}" for n in p["notes"]])


def scale_table(configs: dict[str, ModelConfig], meshes: tuple[str, ...] = TABLE_MESHES,
                device_memory: int = 80 * GIB, kv_bytes_per_scalar: int = 2,
                param_bytes: int = 2, page_size: int = 16, reserve: float = 0.1,
                context: int = 8192) -> str:
    """A markdown table: per-device weights and KV, largest batch and context, per mesh."""
    caption = (f"{param_bytes} B weights, {kv_bytes_per_scalar} B KV scalars, "
               f"{human_bytes(device_memory)} per device, {reserve:.0%} reserved, "
               f"{page_size}-token pages; the page pool is replicated over data. Max context "
               f"is the memory bound, not the model's max_seq_len.")
    lines = [caption, "",
             f"| model | mesh | weights / device | KV / token / device | max batch @ "
             f"{context:,} context | max context @ batch 1 |",
             "|---|---|---:|---:|---:|---:|"]
    for name, config in configs.items():
        for mesh in meshes:
            p = plan(config, mesh, device_memory, kv_bytes_per_scalar, param_bytes, page_size,
                     reserve, batch=1, context=context, contexts=())
            kv = human_bytes(p["kv_bytes_per_token"]) + (" (replicated)" if p["kv_replicated"]
                                                         else "")
            fit = p["kv_budget"] > 0
            lines.append(f"| {name} | {mesh} | {human_bytes(p['weight_bytes'])} | {kv} | "
                         f"{p['max_batch']:,} | "
                         + (f"{p['max_context']:,} |" if fit else "weights do not fit |"))
    return "\n".join(lines)
