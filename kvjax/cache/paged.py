"""The paged KV cache pytree, the batch description passed beside it, and page writes.

Layout (the one the Pallas paged-attention kernels use):
  k, v: [layers, kv_heads, num_pages, page_size, head_dim]
A sequence owns a list of physical pages (its row of the page table); its token at position
p lives in page `page_table[p // page_size]`, slot `p % page_size`.

Int8 pages (`CacheConfig(dtype="int8")`) hold each token's K (and V) of a KV head as int8
with one float32 scale, its largest magnitude / 127 (k_scale, v_scale: [layers, kv_heads,
num_pages, page_size]). Float8 pages (`"float8_e4m3fn"`) are the same with e4m3 numbers and
the largest magnitude at 448 (e4m3's largest): the same bytes, another grid (int8 steps are
even across a vector, e4m3 steps relative to each number). A token is quantized when it is
written, from its own K/V alone, so its stored bits still depend on its own history only;
attention reads number * scale. Int4 pages grouped by the page (`"int4_kivi"`: keys per
channel over a full page, values per token, the page being filled kept float32 in the
row's open page) are `kvjax.cache.kivi`.

On CPU, bfloat16 and float8 pages hold their numbers' bits (uint16, uint8): XLA:CPU writes
into an array of either type by converting the whole array to a wider float and back, which
for a page write is the whole pool at every layer of every step (float8 decode took 69x
float32's time on SmolLM2). Bits scatter in place; reads turn the gathered blocks back into
numbers (a bitcast: the same bits, so the same values on every platform).
"""

from __future__ import annotations

from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import kivi
from kvjax.config import CacheConfig, ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8,
          "float8_e4m3fn": jnp.float8_e4m3fn, "int4_kivi": jnp.uint8}
QUANTIZED = ("int8", "float8_e4m3fn")  # formats stored with a scale per (token, KV head)
_LARGEST = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
BITS = {"bfloat16": jnp.uint16, "float8_e4m3fn": jnp.uint8}  # stored as bits on CPU


def stored_as_bits(dtype: str, platform: str | None = None) -> bool:
    """Whether pages of format `dtype` hold their numbers' bits on `platform` (default: the
    default backend's); module docstring."""
    return dtype in BITS and (platform or jax.default_backend()) == "cpu"


class StoredNumbers:
    """What a cache's k and v hold, for caches with a `numbers` field (module docstring)."""

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the numbers k and v hold."""
        return jnp.dtype(DTYPES[self.numbers]) if self.numbers else self.k.dtype

    def read(self, stored: jax.Array) -> jax.Array:
        """Part of k or v as the numbers it holds."""
        if self.numbers is None:
            return stored
        return jax.lax.bitcast_convert_type(stored, self.dtype)

    def store(self, x: jax.Array) -> jax.Array:
        """Numbers as k and v keep them: rounded to the format (as bits where stored so)."""
        x = x.astype(self.dtype)
        return x if self.numbers is None else jax.lax.bitcast_convert_type(x, self.k.dtype)


@flax.struct.dataclass
class PagedKVCache(StoredNumbers):
    """Immutable paged K/V storage. Steps return a new one; the old one is donated."""

    k: jax.Array  # [layers, kv_heads, num_pages, page_size, head_dim]
    v: jax.Array  # [layers, kv_heads, num_pages, page_size, head_dim]
    block_pages: int = flax.struct.field(pytree_node=False, default=1)
    # int8, float8: float32 [layers, kv_heads, num_pages, page_size]; int4_kivi: float16
    # [..., num_pages, head_dim, 2] and [..., num_pages, page_size, 2] (kvjax.cache.kivi)
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    # int4_kivi (kvjax.cache.kivi): float32 [layers, kv_heads, open_rows, page_size, head_dim]
    open_k: jax.Array | None = None
    open_v: jax.Array | None = None
    # the format whose bits k and v hold (`stored_as_bits`); None: k and v hold numbers
    numbers: str | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


class CacheHolder:
    """A cache (paged or dense) threaded through repeated steps that donate it: benchmarks
    and timings that need no pages of a pool (`PagePool.run` is the same for a pool)."""

    def __init__(self, cache):
        self.cache = cache

    def run(self, step):
        """`step(cache)` returns (result, new cache); the holder keeps the new cache."""
        result, self.cache = step(self.cache)
        return result


@flax.struct.dataclass
class BatchInfo:
    """What the host tells a step about each sequence of the batch.

    New token t of sequence b sits in cache slot `lengths[b] + t` and is real only when
    `t < num_new[b]`; padded tokens are neither written nor attended to. Its model position
    (RoPE angle or learned embedding row) is `position_offset[b] + lengths[b] + t`: the
    offset is the position base of a sequence whose first cached token is not at 0.

    A tree verify (`depth`, `ancestors`): new token t is a node of a token tree at depth
    `depth[b, t]`, whose ancestor at depth j is new token `ancestors[b, t, j]` (itself at
    its own depth; parents before children). It is still written at slot `lengths + t`, but
    its model position is `lengths + depth` and it sees the cache and its ancestors only,
    laid out as plain decoding would have written them (`kvjax.model.attention`).
    """

    page_table: jax.Array  # int32[batch, pages_per_seq]
    lengths: jax.Array  # int32[batch]  tokens already cached
    num_new: jax.Array  # int32[batch]  real new tokens in this step
    position_offset: jax.Array | None = None  # int32[batch]  position of cache slot 0
    # int4_kivi pages: each row's open page (kvjax.cache.kivi); >= open_rows: a padded row
    open_rows: jax.Array | None = None  # int32[batch]
    depth: jax.Array | None = None  # int32[batch, new_tokens]  tree verify
    ancestors: jax.Array | None = None  # int32[batch, new_tokens, new_tokens]  tree verify


def init_cache(model: ModelConfig, cache: CacheConfig, open_rows: int = 0) -> PagedKVCache:
    """A zero-filled cache for `model` with `cache.num_pages` pages (int4_kivi pages: and
    `open_rows` open pages, one per row a step may run)."""
    shape = (model.num_layers, model.num_kv_heads, cache.num_pages, cache.page_size,
             model.head_dim)
    if cache.dtype == "int4_kivi":
        return _init_kivi(shape, cache.block_pages, open_rows)
    bits = stored_as_bits(cache.dtype)
    dtype = BITS[cache.dtype] if bits else DTYPES[cache.dtype]
    scale = (lambda: jnp.zeros(shape[:-1], jnp.float32)) if cache.dtype in QUANTIZED else (
        lambda: None)
    return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        block_pages=cache.block_pages, k_scale=scale(), v_scale=scale(),
                        numbers=cache.dtype if bits else None)


def _init_kivi(shape: tuple, block_pages: int, open_rows: int) -> PagedKVCache:
    layers, kv, pages, page_size, h = shape
    if h % 2 or open_rows < 1:
        raise ValueError(f"int4_kivi pages need an even head_dim (got {h}) and open_rows >= 1 "
                         f"(got {open_rows})")
    packed = (layers, kv, pages, page_size, h // 2)
    open_ = (layers, kv, open_rows, page_size, h)
    return PagedKVCache(k=jnp.zeros(packed, jnp.uint8), v=jnp.zeros(packed, jnp.uint8),
                        block_pages=block_pages,
                        k_scale=jnp.zeros((layers, kv, pages, h, 2), kivi.PARAMS),
                        v_scale=jnp.zeros((*shape[:-1], 2), kivi.PARAMS),
                        open_k=jnp.zeros(open_, jnp.float32),
                        open_v=jnp.zeros(open_, jnp.float32))


def quantize(x: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (`dtype` [..., head_dim], float32 scale [...]): each vector's
    largest magnitude becomes the format's largest (int8 127, e4m3 448), the rest round to
    the nearest number of the format (ties to even); all zeros: scale 0."""
    x = x.astype(jnp.float32)
    top = _LARGEST[jnp.dtype(dtype)]
    scale = jnp.max(jnp.abs(x), axis=-1) / top
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    y = jnp.clip(x / safe, -top, top)
    q = jnp.round(y) if jnp.issubdtype(dtype, jnp.integer) else y
    return q.astype(dtype), scale


def dequantize(q: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """Stored K or V [..., head_dim] (with its scale [...] when quantized) as `dtype`
    numbers."""
    if scale is None:
        return q.astype(dtype)
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def cache_bytes(cache) -> int:
    """Physical bytes of a cache's K and V arrays (paged or dense; `jax.eval_shape` too)."""
    return _nbytes(cache.k, cache.v, cache.k_scale, cache.v_scale,
                   getattr(cache, "open_k", None), getattr(cache, "open_v", None))


def _nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays
               if a is not None)


def new_positions(batch: BatchInfo, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Cache slots of the new tokens and which of them are real: both [batch, num_tokens]."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    valid = t < batch.num_new[:, None]
    positions = jnp.where(valid, batch.lengths[:, None] + t, 0)
    return positions, valid


def model_positions(batch: BatchInfo, num_tokens: int) -> jax.Array:
    """Model positions of the new tokens [batch, num_tokens] (0 for padded ones)."""
    slots, valid = new_positions(batch, num_tokens)
    if batch.depth is not None:  # a tree node sits where plain decoding would put it
        slots = jnp.where(valid, batch.lengths[:, None] + batch.depth, 0)
    if batch.position_offset is None:
        return slots
    return jnp.where(valid, slots + batch.position_offset[:, None], 0)


def write_kv(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array,
             batch: BatchInfo) -> PagedKVCache:
    """Writes the new tokens' K/V into their pages; padded tokens are dropped.

    Args:
      k, v: [batch, new_tokens, kv_heads, head_dim]
    """
    positions, valid = new_positions(batch, k.shape[1])
    page_size = cache.page_size
    page = jnp.take_along_axis(batch.page_table, positions // page_size, axis=1)
    page = jnp.where(valid, page, cache.num_pages)  # out of range: dropped
    slot = positions % page_size
    # Non-adjacent advanced indices put the [batch, new_tokens] axes first, so the update
    # has k's own layout [batch, new_tokens, kv_heads, head_dim].
    if cache.k_scale is not None:
        (k, k_scale), (v, v_scale) = quantize(k, cache.dtype), quantize(v, cache.dtype)
        cache = cache.replace(
            k_scale=cache.k_scale.at[layer, :, page, slot].set(k_scale, mode="drop"),
            v_scale=cache.v_scale.at[layer, :, page, slot].set(v_scale, mode="drop"))
    new_k = cache.k.at[layer, :, page, slot].set(cache.store(k), mode="drop")
    new_v = cache.v.at[layer, :, page, slot].set(cache.store(v), mode="drop")
    return cache.replace(k=new_k, v=new_v)


@partial(jax.jit, donate_argnames=("cache",))
def copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copies pages src[i] -> dst[i] (int32[n]); dst ids >= num_pages are ignored.

    Donates `cache`. Copy-on-write and partial-page reuse both go through here.
    """
    def copy(a):
        return None if a is None else a.at[:, :, dst].set(a[:, :, src], mode="drop")

    return cache.replace(k=copy(cache.k), v=copy(cache.v), k_scale=copy(cache.k_scale),
                         v_scale=copy(cache.v_scale))


def move_slots(cache: PagedKVCache, page_table: jax.Array, lengths: jax.Array,
               src: jax.Array, count: jax.Array) -> PagedKVCache:
    """After a tree verify: row b's K/V at slot `lengths[b] + src[b, j]` move to slot
    `lengths[b] + j`, for j < count[b] (the accepted path, laid out as plain decoding writes
    it; every source is read before any slot is written). Jitted with the cache donated.

    Args:
      page_table: int32[B, P]; lengths, count: int32[B]; src: int32[B, J]
    """
    if cache.open_k is not None:
        raise NotImplementedError("moving slots of int4_kivi pages")
    return _move_slots(cache, page_table, lengths, src, count)


@partial(jax.jit, donate_argnames=("cache",))
def _move_slots(cache, page_table, lengths, src, count):
    j = jnp.arange(src.shape[1], dtype=jnp.int32)[None, :]

    def at(slots):  # [B, J] -> (page, slot in page)
        pages = jnp.take_along_axis(page_table, slots // cache.page_size, axis=1)
        return pages, slots % cache.page_size

    from_page, from_slot = at(lengths[:, None] + src)
    to_page, to_slot = at(lengths[:, None] + j)
    to_page = jnp.where(j < count[:, None], to_page, cache.num_pages)  # out of range: dropped

    def move(a):  # [layers, K, pages, page_size, ...]; the update [layers, K, B, J, ...]
        if a is None:
            return None
        return a.at[:, :, to_page, to_slot].set(a[:, :, from_page, from_slot], mode="drop")

    return cache.replace(k=move(cache.k), v=move(cache.v), k_scale=move(cache.k_scale),
                         v_scale=move(cache.v_scale))


# The arrays a page is made of, in the order page reads and writes list them.
PAGE_FIELDS = ("k", "v", "k_scale", "v_scale")


def bytes_per_page(cache: PagedKVCache) -> int:
    """Bytes of one page: its share of the `PAGE_FIELDS` arrays (int4_kivi's open pages are
    per slot, not per page)."""
    return _nbytes(*(getattr(cache, name) for name in PAGE_FIELDS)) // cache.num_pages


def page_layout(cache: PagedKVCache) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of one page's part of each `PAGE_FIELDS` array the cache has
    (the pages axis left out): what a page kept below the device must hold to come back."""
    return {name: (str(a.dtype), a.shape[:2] + a.shape[3:])
            for name in PAGE_FIELDS if (a := getattr(cache, name)) is not None}


@jax.jit
def read_pages(cache: PagedKVCache, pages: jax.Array) -> dict[str, jax.Array]:
    """The stored K/V of pages (int32[n]; an id >= num_pages reads zeros): each field of
    `PAGE_FIELDS` the cache has, pages first: k, v [n, layers, kv_heads, page_size,
    head_dim]; quantized pages' k_scale, v_scale [n, layers, kv_heads, page_size] (int4_kivi
    pages': `kvjax.cache.kivi`'s shapes)."""
    out = {}
    for name in PAGE_FIELDS:
        a = getattr(cache, name)
        if a is not None:
            out[name] = jnp.moveaxis(a.at[:, :, pages].get(mode="fill", fill_value=0), 2, 0)
    return out


@partial(jax.jit, donate_argnames=("cache",))
def write_pages(cache: PagedKVCache, pages: jax.Array,
                arrays: dict[str, jax.Array]) -> PagedKVCache:
    """Stores `arrays` (as `read_pages` returns them) into pages (int32[n]; ids >= num_pages
    are ignored), bit for bit. Donates `cache`."""
    return cache.replace(**{
        name: getattr(cache, name).at[:, :, pages].set(jnp.moveaxis(a, 0, 2), mode="drop")
        for name, a in arrays.items()})


@partial(jax.jit, donate_argnames=("cache",))
def poison_pages(cache: PagedKVCache, pages: jax.Array) -> PagedKVCache:
    """Fills pages (int32[n]; ids >= num_pages ignored) with NaN (quantized pages: their scales,
    so every value read from them is NaN). Donates `cache`."""
    if cache.k_scale is not None:
        return cache.replace(k_scale=cache.k_scale.at[:, :, pages].set(jnp.nan, mode="drop"),
                             v_scale=cache.v_scale.at[:, :, pages].set(jnp.nan, mode="drop"))
    nan = cache.store(jnp.float32(jnp.nan))
    k = cache.k.at[:, :, pages].set(nan, mode="drop")
    v = cache.v.at[:, :, pages].set(nan, mode="drop")
    return cache.replace(k=k, v=v)


def padded_ids(ids: list[int], fill: int) -> np.ndarray:
    """int32 ids padded to a power-of-two length with `fill` (bounds compilations)."""
    n = 1
    while n < len(ids):
        n *= 2
    out = np.full(n, fill, np.int32)
    out[: len(ids)] = ids
    return out
