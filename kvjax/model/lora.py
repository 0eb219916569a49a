"""LoRA adapters: rank-r deltas on the attention (q, k, v, o) and MLP projections.

An adapter is a pytree `{"layer_i": {"attn": {"q": {"a": [in, r], "b": [r, out]}, ...},
"mlp": {...}}}`; the delta of a projection is `(x @ a) @ b`. Several adapters are stacked
along a leading axis (index 0 is "no adapter": zeros, which add exactly nothing) and each
sequence of a batch picks its own with `adapter_ids`.

Legend: A adapters, B batch, T tokens, I projection input width, R rank, O output width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.model.tiled import tree_sum


def lora_targets(config: ModelConfig) -> dict[str, dict[str, tuple[int, int]]]:
    """(input width, output width) of every projection an adapter may change."""
    d, h = config.d_model, config.head_dim
    attn = {"q": (d, config.num_heads * h), "k": (d, config.num_kv_heads * h),
            "v": (d, config.num_kv_heads * h), "o": (config.num_heads * h, d)}
    names = ("gate", "up") if config.mlp in ("swiglu", "geglu") else ("up",)
    mlp = dict.fromkeys(names, (d, config.d_ff))
    mlp["down"] = (config.d_ff, d)
    return {"attn": attn, "mlp": mlp}


def init_adapter(config: ModelConfig, rank: int, seed: int = 0,
                 scale: float = 0.02) -> dict:
    """A random rank-`rank` adapter (both factors random, so it changes the outputs)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    rng = np.random.default_rng(seed)
    adapter = {}
    for layer in range(config.num_layers):
        adapter[f"layer_{layer}"] = {
            part: {name: {"a": rng.normal(0, i**-0.5, (i, rank)).astype(np.float32),
                          "b": rng.normal(0, scale, (rank, o)).astype(np.float32)}
                   for name, (i, o) in targets.items()}
            for part, targets in lora_targets(config).items()}
    return jax.tree_util.tree_map(jnp.asarray, adapter)


def stack_adapters(config: ModelConfig, adapters: list[dict]) -> dict:
    """Stacks adapters into the model's "lora" collection; index 0 is the zero adapter.

    Ranks may differ: smaller ones are zero-padded (which adds exactly nothing).
    """
    rank = max([1] + [a["layer_0"]["attn"]["q"]["a"].shape[1] for a in adapters])
    stacked = {}
    for layer in range(config.num_layers):
        key = f"layer_{layer}"
        stacked[key] = {}
        for part, targets in lora_targets(config).items():
            stacked[key][part] = {}
            for name, (i, o) in targets.items():
                a = np.zeros((len(adapters) + 1, i, rank), np.float32)
                b = np.zeros((len(adapters) + 1, rank, o), np.float32)
                for n, adapter in enumerate(adapters, start=1):
                    factors = adapter[key][part][name]
                    r = factors["a"].shape[1]
                    a[n, :, :r] = factors["a"]
                    b[n, :r] = factors["b"]
                stacked[key][part][f"{name}_a"] = jnp.asarray(a)
                stacked[key][part][f"{name}_b"] = jnp.asarray(b)
    return stacked


def add_lora(module: nn.Module, name: str, x: jax.Array, y: jax.Array,
             adapter_ids: jax.Array | None, in_dims: int = 1,
             invariant: bool = False) -> jax.Array:
    """y + the selected adapter's delta for projection `name` (y unchanged without LoRA).

    `invariant` computes each token's delta on its own, as products and fixed-order sums
    (`tree_sum`): a batched einsum's row bits change with the number of tokens.

    Args:
      x: [B, T, *in] the projection input (`in_dims` trailing input axes); y: [B, T, *out].
      adapter_ids: int32[B] rows of the stacked adapters, or None.
    """
    if adapter_ids is None or not module.has_variable("lora", f"{name}_a"):
        return y
    a = module.get_variable("lora", f"{name}_a")[adapter_ids].astype(x.dtype)  # [B, I, R]
    b = module.get_variable("lora", f"{name}_b")[adapter_ids].astype(x.dtype)  # [B, R, O]
    flat = x.reshape(*x.shape[:2], -1) if in_dims > 1 else x  # [B, T, I]
    if invariant:
        xa = tree_sum(flat[:, :, None, :] * jnp.swapaxes(a, 1, 2)[:, None])  # [B, T, R]
        delta = tree_sum(xa[:, :, None, :] * jnp.swapaxes(b, 1, 2)[:, None])  # [B, T, O]
    else:
        delta = jnp.einsum("BTR,BRO->BTO", jnp.einsum("BTI,BIR->BTR", flat, a), b)
    return y + delta.reshape(y.shape)
