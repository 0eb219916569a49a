"""Int4 pages grouped by the page, KIVI-style (`CacheConfig(dtype="int4_kivi")`): keys
quantized per channel over a full page, values per token; the page being filled stays
float32 until its last token is written.

Layout (beside `kvjax.cache.paged`'s):
  k, v: uint8 [layers, kv_heads, num_pages, page_size, head_dim // 2]  two int4 a byte
  k_scale: float32 [layers, kv_heads, num_pages, head_dim]  a channel's over its page
  v_scale: float32 [layers, kv_heads, num_pages, page_size]  a token's over its channels
  open_k, open_v: float32 [layers, kv_heads, open_rows, page_size, head_dim]  each running
    row's page being filled (`BatchInfo.open_rows` names a row's)

What a query sees: at position p, the keys and values of its own page up to p as the step
computed them (float32), and every earlier page as its int4 numbers times their scales.
A page is quantized once, when its last token is written, from its tokens' float K/V,
whichever call wrote them (a prefill chunk spanning pages or one decode token at a time);
those depend on the tokens' own histories only, so a token's bits still do. Keys get a
scale per channel because a few channels of a key carry most of its magnitude (KIVI:
per-token scales would spend their steps on those); values mix channels evenly.

Numbers are symmetric: the largest magnitude of a group becomes +-7 and the rest round to
the nearest step (ties to even); an all-zero group stores scale 0.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

LARGEST = 7.0  # int4 numbers in [-7, 7]: symmetric about 0 (-8 unused)


def pack(q: jax.Array) -> jax.Array:
    """int8 [..., H] in [-8, 7] -> uint8 [..., H // 2]: element 2i in the low nibble,
    2i + 1 in the high one (two's complement)."""
    nibbles = q.astype(jnp.uint8) & 0xF
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack(u: jax.Array) -> jax.Array:
    """uint8 [..., H // 2] -> int8 [..., H] (`pack`'s inverse; the sign from the nibble)."""
    low = (u << 4).astype(jnp.int8) >> 4
    high = u.astype(jnp.int8) >> 4
    return jnp.stack([low, high], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])


def _quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """x float -> (int8 numbers in [-7, 7], float32 scale with `axis` reduced)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis) / LARGEST
    safe = jnp.expand_dims(jnp.where(scale > 0, scale, 1.0), axis)
    return jnp.clip(jnp.round(x / safe), -LARGEST, LARGEST).astype(jnp.int8), scale


def quantize_page(k: jax.Array, v: jax.Array):
    """A full page's K and V [..., page_size, H] -> (k uint8 [..., page_size, H // 2],
    k_scale [..., H], v uint8 [..., page_size, H // 2], v_scale [..., page_size])."""
    kq, k_scale = _quantize(k, axis=-2)  # per channel over the page's tokens
    vq, v_scale = _quantize(v, axis=-1)  # per token over its channels
    return pack(kq), k_scale, pack(vq), v_scale


def dequantize_keys(k: jax.Array, k_scale: jax.Array, dtype) -> jax.Array:
    """uint8 [..., page_size, H // 2] and scale [..., H] -> [..., page_size, H]."""
    return (unpack(k).astype(jnp.float32) * k_scale[..., None, :]).astype(dtype)


def dequantize_values(v: jax.Array, v_scale: jax.Array, dtype) -> jax.Array:
    """uint8 [..., page_size, H // 2] and scale [..., page_size] -> [..., page_size, H]."""
    return (unpack(v).astype(jnp.float32) * v_scale[..., None]).astype(dtype)


@flax.struct.dataclass
class Fresh:
    """A call's float K/V from the start of each row's page being filled: that page's
    earlier tokens, then the new ones (what its queries see of their own pages)."""

    k: jax.Array  # float32 [B, W, kv_heads, H], W = page_size * (1 + ceil(T / page_size))
    v: jax.Array
    base: jax.Array  # int32 [B] position of k[:, 0]


def write(cache, layer: int, k: jax.Array, v: jax.Array, batch):
    """Writes the new tokens' K/V [B, T, kv_heads, H]: every page they complete is quantized
    into its pool page, the page left being filled goes to the row's open page. Returns
    (cache, Fresh)."""
    b, t, kv, h = k.shape
    ps = cache.page_size
    base = batch.lengths // ps * ps  # [B] the page being filled starts here
    n_pages = 1 + -(-t // ps)
    rows = batch.open_rows  # [B] (>= open_rows: a padded row, dropped)

    def window(open_, new):  # [B, W, K, H]: the open page's tokens, then the new ones
        old = open_[layer].at[:, rows].get(mode="fill", fill_value=0)  # [K, B, ps, H]
        w = jnp.zeros((b, n_pages * ps, kv, h), jnp.float32)
        w = w.at[:, :ps].set(jnp.transpose(old, (1, 2, 0, 3)))
        at = jnp.arange(t, dtype=jnp.int32)[None, :]
        at = jnp.where(at < batch.num_new[:, None], batch.lengths[:, None] - base[:, None] + at,
                       n_pages * ps)
        return w.at[jnp.arange(b)[:, None], at].set(new.astype(jnp.float32), mode="drop")

    wk, wv = window(cache.open_k, k), window(cache.open_v, v)
    end = batch.lengths + batch.num_new  # [B]
    j = jnp.arange(n_pages, dtype=jnp.int32)[None, :]
    full = base[:, None] + (j + 1) * ps <= end[:, None]  # [B, n_pages] completed here
    index = jnp.minimum(base[:, None] // ps + j, batch.page_table.shape[1] - 1)
    page = jnp.where(full, jnp.take_along_axis(batch.page_table, index, axis=1),
                     cache.num_pages)  # [B, n_pages]; out of range: dropped
    group = lambda w: jnp.transpose(  # noqa: E731  [B, n_pages, K, ps, H]
        w.reshape(b, n_pages, ps, kv, h), (0, 1, 3, 2, 4))
    kq, k_scale, vq, v_scale = quantize_page(group(wk), group(wv))
    cache = cache.replace(
        k=cache.k.at[layer, :, page].set(kq, mode="drop"),
        v=cache.v.at[layer, :, page].set(vq, mode="drop"),
        k_scale=cache.k_scale.at[layer, :, page].set(k_scale, mode="drop"),
        v_scale=cache.v_scale.at[layer, :, page].set(v_scale, mode="drop"))
    start = end // ps * ps - base  # [B] the page left being filled, in the window
    take = start[:, None] + jnp.arange(ps, dtype=jnp.int32)[None, :]  # [B, ps]
    left = lambda w: jnp.transpose(  # noqa: E731  [B, K, ps, H]
        jnp.take_along_axis(w, take[:, :, None, None], axis=1), (0, 2, 1, 3))
    cache = cache.replace(
        open_k=cache.open_k.at[layer, :, rows].set(left(wk), mode="drop"),
        open_v=cache.open_v.at[layer, :, rows].set(left(wv), mode="drop"))
    return cache, Fresh(k=wk, v=wv, base=base)
