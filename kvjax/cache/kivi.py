"""Int4 pages grouped by the page, KIVI-style (`CacheConfig(dtype="int4_kivi")`): keys
quantized per channel over a full page, values per token; the page being filled stays
float32 until its last token is written.

Layout (beside `kvjax.cache.paged`'s):
  k, v: uint8 [layers, kv_heads, num_pages, page_size, head_dim // 2]  two int4 a byte
  k_scale: float16 [layers, kv_heads, num_pages, head_dim, 2]  a channel's (step, minimum)
    over its page
  v_scale: float16 [layers, kv_heads, num_pages, page_size, 2]  a token's over its channels
  open_k, open_v: float32 [layers, kv_heads, open_rows, page_size, head_dim]  each running
    row's page being filled (`BatchInfo.open_rows` names a row's)

What a query sees: at position p, the keys and values of its own page up to p as the step
computed them (float32), and every earlier page as its int4 numbers times their steps plus
their minimums. A page is quantized once, when its last token is written, from its tokens'
float K/V, whichever call wrote them (a prefill chunk spanning pages or one decode token at
a time); those depend on the tokens' own histories only, so a token's bits still do. Keys
get their numbers per channel because a few channels of a key carry most of its magnitude
(KIVI: per-token groups would spend their steps on those); values mix channels evenly.

Numbers are asymmetric, as KIVI's: a group's minimum becomes 0 and its maximum 15, the rest
round to the nearest of the 16 levels (ties to even). A key channel over 16 tokens sits
mostly to one side of 0, so min..max is a narrower range than -max|x|..max|x|: on SmolLM2's
K/V the relative error is half the symmetric one's for keys (0.029 vs 0.061) and 0.80 of it
for values. Step and minimum are float16, the bytes one float32 scale took: the minimum
rounded down and the step up, and the numbers computed from those stored ones, so every
number is within half a stored step of its value (float16's range is the format's: a
minimum below -65,504 or a step above 65,504 saturates there).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

LEVELS = 15  # int4 numbers 0..15: the group's minimum to its maximum
PARAMS = jnp.float16  # a group's (step, minimum)
_FLOAT16_MAX = 65504.0


def pack(q: jax.Array) -> jax.Array:
    """uint8 [..., H] in [0, 15] -> uint8 [..., H // 2]: element 2i in the low nibble,
    2i + 1 in the high one."""
    nibbles = q.astype(jnp.uint8) & 0xF
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack(u: jax.Array) -> jax.Array:
    """uint8 [..., H // 2] -> uint8 [..., H] in [0, 15] (`pack`'s inverse)."""
    return jnp.stack([u & 0xF, u >> 4], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])


def _round_toward(x: jax.Array, toward: float) -> jax.Array:
    """float32 -> float16, rounded toward -inf or +inf instead of to nearest."""
    y = x.astype(PARAMS)
    past = y.astype(jnp.float32) > x if toward < 0 else y.astype(jnp.float32) < x
    return jnp.where(past, jnp.nextafter(y, jnp.asarray(toward, PARAMS)), y)


def _quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """x float -> (uint8 numbers in [0, 15], float16 [..., 2] (step, minimum) with `axis`
    reduced). The minimum is rounded down to float16 and the step up, so that the stored
    grid covers the group: every number is within half a stored step of its value."""
    x = x.astype(jnp.float32)
    low = _round_toward(jnp.clip(jnp.min(x, axis=axis), -_FLOAT16_MAX, _FLOAT16_MAX), -jnp.inf)
    low32 = low.astype(jnp.float32)
    step = _round_toward(jnp.minimum((jnp.max(x, axis=axis) - low32) / LEVELS, _FLOAT16_MAX),
                         jnp.inf)
    step32 = step.astype(jnp.float32)
    safe = jnp.expand_dims(jnp.where(step32 > 0, step32, 1.0), axis)
    q = jnp.round((x - jnp.expand_dims(low32, axis)) / safe)
    return jnp.clip(q, 0, LEVELS).astype(jnp.uint8), jnp.stack([step, low], axis=-1)


def quantize_page(k: jax.Array, v: jax.Array):
    """A full page's K and V [..., page_size, H] -> (k uint8 [..., page_size, H // 2],
    k_scale [..., H, 2], v uint8 [..., page_size, H // 2], v_scale [..., page_size, 2])."""
    kq, k_scale = _quantize(k, axis=-2)  # per channel over the page's tokens
    vq, v_scale = _quantize(v, axis=-1)  # per token over its channels
    return pack(kq), k_scale, pack(vq), v_scale


def _dequantize(q: jax.Array, params: jax.Array, dtype) -> jax.Array:
    params = params.astype(jnp.float32)
    return (unpack(q).astype(jnp.float32) * params[..., 0] + params[..., 1]).astype(dtype)


def dequantize_keys(k: jax.Array, k_scale: jax.Array, dtype) -> jax.Array:
    """uint8 [..., page_size, H // 2] and (step, minimum) [..., H, 2] -> [..., page_size, H]."""
    return _dequantize(k, k_scale[..., None, :, :], dtype)


def dequantize_values(v: jax.Array, v_scale: jax.Array, dtype) -> jax.Array:
    """uint8 [..., page_size, H // 2] and (step, minimum) [..., page_size, 2] ->
    [..., page_size, H]."""
    return _dequantize(v, v_scale[..., None, :], dtype)


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
