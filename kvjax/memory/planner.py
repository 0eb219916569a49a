"""Per-device memory on a ("data", "model") mesh: weights, KV, the largest batch x context.

Prices a mesh this machine need not have: it builds the parameter tree with
`jax.eval_shape` (nothing allocated) and splits every array by the rules table of
`kvjax.sharding`. The single-device calculator it builds on is `kvjax.memory.calculator`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import sharding
from kvjax.config import ConfigError, ModelConfig
from kvjax.memory.calculator import human_bytes, kv_bytes
from kvjax.model.transformer import param_shapes

GIB = 2**30
PLAN_CONTEXTS = (2048, 8192, 32768, 131072)  # the "largest batch by context" rows
TABLE_MESHES = ("model=1", "model=8", "data=2,model=4")
LARGE_CONFIGS = ("configs/models/llama3_8b.toml", "configs/models/llama3_70b.toml")

PLAN_ASSUMPTIONS = (
    "every sequence stores the KV of all its tokens, rounded up to whole pages, with no "
    "prefix sharing; the reserve stands for activations, logits and XLA workspace (an "
    "assumption, not measured)."
)



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
                                  kv_bytes_per_scalar: float,
                                  notes: list[str] | None = None) -> int:
    """K and V bytes one token adds on each device: KV heads split over "model" (or not)."""
    spec = sharding.cache_spec(config, sizes, notes)
    one_token = (config.num_layers, config.num_kv_heads, 1, 1, config.head_dim)  # [L, K, 1, 1, H]
    return round(2 * kv_bytes_per_scalar * _scalars(one_token, spec, sizes))


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
