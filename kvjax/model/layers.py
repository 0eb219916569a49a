"""Building blocks chosen by ModelConfig: norms, positions, MLPs.

Legend: B batch, T tokens, N heads, H head dim, D model width, F feed-forward width.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from kvjax.config import ModelConfig
from kvjax.cpu.product import KernelDot, product
from kvjax.model.lora import add_lora
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.model.tiled import RowInvariantDot, tree_sum

EMBED_INIT = nn.initializers.normal(stddev=0.02)


def row_dot(plan: NumericsPlan, product: str) -> RowInvariantDot | KernelDot | None:
    """The `dot_general` of one of the model's token-row products (a name in
    `kvjax.model.plan.ROW_PRODUCTS`): kvjax's CPU kernel when the plan says so; else
    row-invariant blocks under an invariant plan, XLA's own choice (None) otherwise."""
    if plan.cpu_kernel:
        return KernelDot()
    if not plan.invariant:
        return None
    return RowInvariantDot(plan.block(product))


def row_mean(x: jax.Array) -> jax.Array:
    """Mean over the last axis, keepdims, summed in a fixed order (`tree_sum`): a plain
    `mean` changes a row's last bits with the number of rows (XLA CPU, from 5 rows of
    49,152 or 8 rows of 576, measured)."""
    return (tree_sum(x) / x.shape[-1])[..., None]


def row_log_softmax(x: jax.Array) -> jax.Array:
    """Log-softmax over the last axis, its sum in a fixed order (`tree_sum`):
    `jax.nn.log_softmax` changes a row's last bits with the number of rows."""
    shifted = x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True))
    return shifted - jnp.log(tree_sum(jnp.exp(shifted)))[..., None]


def layer_param(module: nn.Module, name: str, init, shape: tuple, index) -> jax.Array:
    """A parameter of one layer, [*shape]; with `module.stack` layers stacked (the layer
    loop: `kvjax.model.layout.stack_layers`), [stack, *shape] and layer `index`'s."""
    if not module.stack:
        return module.param(name, init, shape)
    return module.param(name, init, (module.stack, *shape))[index]


class StackedLinear(nn.Module):
    """Flax's Dense/DenseGeneral under the CPU kernel's plan, for a stack of layers: kernel
    [stack, in..., out...] (each layer's packed), bias [stack, out...]; layer `index`'s
    product read in place (`kvjax.cpu.product.product(..., layer=)`), the same arithmetic,
    dtype promotion and bias as Flax's module with `KernelDot`: the same bits."""

    features: tuple[int, ...]
    inputs: int  # the input's trailing axes contracted
    stack: int
    use_bias: bool
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x: jax.Array, index: jax.Array) -> jax.Array:
        ins = x.shape[x.ndim - self.inputs:]
        kernel = self.param("kernel", nn.initializers.zeros, (self.stack, *ins, *self.features))
        bias = (self.param("bias", nn.initializers.zeros, (self.stack, *self.features))[index]
                if self.use_bias else None)
        x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
        rows, n_in, n_out = x.shape[:x.ndim - self.inputs], math.prod(ins), math.prod(
            self.features)
        y = product(x.reshape(-1, n_in), kernel.reshape(self.stack, n_in, n_out), layer=index)
        y = y.reshape(*rows, *self.features).astype(jnp.result_type(x, kernel))
        return y if bias is None else y + bias


class RMSNorm(nn.Module):
    eps: float = 1e-5
    stack: int = 0  # > 0: the scales of that many layers (`layer_param`)

    @nn.compact
    def __call__(self, x: jax.Array, index: jax.Array | None = None) -> jax.Array:
        scale = layer_param(self, "scale", nn.initializers.ones, (x.shape[-1],), index)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(row_mean(x32 * x32) + self.eps)
        return (normed * scale).astype(x.dtype)


class LayerNorm(nn.Module):
    """Layer normalisation with Flax's parameter names (scale, bias) and row-invariant means."""

    eps: float = 1e-5
    stack: int = 0  # > 0: the parameters of that many layers (`layer_param`)

    @nn.compact
    def __call__(self, x: jax.Array, index: jax.Array | None = None) -> jax.Array:
        d = x.shape[-1]
        scale = layer_param(self, "scale", nn.initializers.ones, (d,), index)
        bias = layer_param(self, "bias", nn.initializers.zeros, (d,), index)
        x32 = x.astype(jnp.float32)
        centred = x32 - row_mean(x32)
        normed = centred * jax.lax.rsqrt(row_mean(centred * centred) + self.eps)
        return (normed * scale + bias).astype(x.dtype)


def make_norm(config: ModelConfig, name: str, stack: int = 0) -> nn.Module:
    if config.norm == "rms":
        return RMSNorm(eps=config.norm_eps, stack=stack, name=name)
    return LayerNorm(eps=config.norm_eps, stack=stack, name=name)


def rope_frequencies(head_dim: int, theta: float, scaling: tuple = ()) -> tuple[jax.Array, float]:
    """(inverse frequencies [H/2], cos/sin amplitude) of RoPE with base `theta` and
    `scaling` (`ModelConfig.rope_scaling`), as transformers' rope utilities compute them in
    float32: "linear" divides every frequency by `factor`; "dynamic" is plain RoPE within
    `max_seq_len`; "llama3" divides the low ones and
    blends the middle band; "yarn" blends interpolated and extrapolated frequencies over a
    ramp of dimensions and scales cos/sin by `attention_factor`."""
    h = head_dim
    exponents = jnp.arange(0, h, 2, dtype=jnp.float32) / h
    inv_freq = 1.0 / (theta ** exponents)  # [H/2]
    s = dict(scaling)
    kind = s.get("rope_type")
    if kind in (None, "dynamic"):  # dynamic: plain up to max_seq_len (ModelConfig checks)
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        context = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < context / high) & ~(wavelen > context / low)
        return jnp.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        factor, context = s["factor"], s["original_max_position_embeddings"]

        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
            return h * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
        if s["truncate"]:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, h - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = jnp.clip((jnp.arange(h // 2, dtype=jnp.float32) - lo) / (hi - lo), 0, 1)
        extrapolated = 1 - ramp
        pos_freqs = theta ** exponents
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) \
            + (1.0 / pos_freqs) * extrapolated
        return inv_freq, float(s["attention_factor"])
    raise ValueError(f"rope_type {kind!r}")


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, scaling: tuple = ()) -> jax.Array:
    """Rotary embedding, rotate-half convention (Llama/Hugging Face layout).

    Args:
      x: [B, T, N, H]; positions: int32[B, T].
    """
    h = x.shape[-1]
    inv_freq, amplitude = rope_frequencies(h, theta, scaling)  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if amplitude != 1.0:
        cos, sin = cos * amplitude, sin * amplitude
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., h // 2:], x32[..., : h // 2]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class MLP(nn.Module):
    config: ModelConfig
    plan: NumericsPlan = FAST
    stack: int = 0  # > 0: the kernels of that many layers, layer `index`'s used

    @nn.compact
    def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None,
                 index: jax.Array | None = None) -> jax.Array:
        """[B, T, D] -> [B, T, D]; adapter_ids int32[B] selects LoRA deltas (see lora.py)."""
        cfg, plan = self.config, self.plan

        def product(inputs: jax.Array, features: int, name: str) -> jax.Array:
            if self.stack:
                return StackedLinear((features,), 1, self.stack, cfg.mlp_bias, cfg.dtype,
                                     name=name)(inputs, index)
            return nn.Dense(features, use_bias=cfg.mlp_bias, dtype=cfg.dtype,
                            dot_general=row_dot(plan, "mlp down" if name == "down" else
                                                "mlp up"), name=name)(inputs)

        lora_block = plan.block("lora") if plan.invariant else None

        def lora(inputs: jax.Array, y: jax.Array, name: str) -> jax.Array:
            return add_lora(self, name, inputs, y, adapter_ids, block=lora_block)

        if cfg.mlp == "gelu":
            hidden = nn.gelu(lora(x, product(x, cfg.d_ff, "up"), "up"), approximate=True)
        else:
            if plan.fused:  # one product, split after (kvjax.model.layout.fuse)
                gate, up = jnp.split(product(x, 2 * cfg.d_ff, "gate_up"), 2, axis=-1)
            else:
                gate, up = product(x, cfg.d_ff, "gate"), product(x, cfg.d_ff, "up")
            gate, up = lora(x, gate, "gate"), lora(x, up, "up")  # [B, T, F]
            # swiglu, or geglu's tanh-approximated GELU gate (Gemma)
            hidden = (nn.silu(gate) if cfg.mlp == "swiglu" else
                      nn.gelu(gate, approximate=True)) * up
        return lora(hidden, product(hidden, cfg.d_model, "down"), "down")
