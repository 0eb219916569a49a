"""Building blocks chosen by ModelConfig: norms, positions, MLPs.

Legend: B batch, T tokens, N heads, H head dim, D model width, F feed-forward width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.model.lora import add_lora
from kvjax.model.tiled import RowInvariantDot, tree_sum

EMBED_INIT = nn.initializers.normal(stddev=0.02)


def row_dot(config: ModelConfig, product: str) -> RowInvariantDot | None:
    """The `dot_general` of one of the model's token-row products (a name in
    `kvjax.config.ROW_PRODUCTS`): row-invariant blocks under `numerics="invariant"`,
    XLA's own choice (None) otherwise."""
    if config.numerics != "invariant":
        return None
    return RowInvariantDot(config.block(product))


def row_mean(x: jax.Array) -> jax.Array:
    """Mean over the last axis, keepdims, summed in a fixed order (`tree_sum`): a plain
    `mean` changes a row's last bits with the number of rows (XLA CPU, from 5 rows of
    49,152 or 8 rows of 576, measured)."""
    return (tree_sum(x) / x.shape[-1])[..., None]


class RMSNorm(nn.Module):
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(row_mean(x32 * x32) + self.eps)
        return (normed * scale).astype(x.dtype)


class LayerNorm(nn.Module):
    """Layer normalisation with Flax's parameter names (scale, bias) and row-invariant means."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,))
        bias = self.param("bias", nn.initializers.zeros, (d,))
        x32 = x.astype(jnp.float32)
        centred = x32 - row_mean(x32)
        normed = centred * jax.lax.rsqrt(row_mean(centred * centred) + self.eps)
        return (normed * scale + bias).astype(x.dtype)


def make_norm(config: ModelConfig, name: str) -> nn.Module:
    if config.norm == "rms":
        return RMSNorm(eps=config.norm_eps, name=name)
    return LayerNorm(eps=config.norm_eps, name=name)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half convention (Llama/Hugging Face layout).

    Args:
      x: [B, T, N, H]; positions: int32[B, T].
    """
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., h // 2:], x32[..., : h // 2]], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> jax.Array:
        """[B, T, D] -> [B, T, D]; adapter_ids int32[B] selects LoRA deltas (see lora.py)."""
        cfg = self.config

        def dense(inputs: jax.Array, features: int, name: str) -> jax.Array:
            product = "mlp down" if name == "down" else "mlp up"
            y = nn.Dense(features, use_bias=cfg.mlp_bias, dtype=cfg.dtype,
                         dot_general=row_dot(cfg, product), name=name)(inputs)
            return add_lora(self, name, inputs, y, adapter_ids, invariant=cfg.numerics ==
                            "invariant")

        if cfg.mlp == "swiglu":
            hidden = nn.silu(dense(x, cfg.d_ff, "gate")) * dense(x, cfg.d_ff, "up")  # [B, T, F]
        else:
            hidden = nn.gelu(dense(x, cfg.d_ff, "up"), approximate=True)
        return dense(hidden, cfg.d_model, "down")
